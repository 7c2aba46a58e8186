"""Train the tensor-parallel novel GPT, and generate text with it.

`train(...)` runs on every rank (launched by `tpedu.launch`, the CLI, or torchrun). Every rank
of the TP group builds the same dense model from the same seed, shards it, draws the same batch
(seeded by the step), and updates only its own shards; the loss is the same on every rank.

Saved models are a directory: `config.json` (model + training settings), `tokenizer.json`, and
`model.safetensors` with the *dense* state dict (gathered from the shards), written atomically
(temporary directory, then rename). Sharded, reshardable checkpoints are lesson 13.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from tpedu import corpus, tokenizer
from tpedu.batches import packed_batch
from tpedu.launcher import device
from tpedu.model import TPGPT, DenseGPT, GPTConfig
from tpedu.vocab_parallel import sample, vocab_parallel_sample

CACHE_DIR = Path(os.environ.get("TPEDU_CACHE", Path(__file__).resolve().parent.parent / ".cache"))


@dataclass
class TrainConfig:
    steps: int = 200
    batch: int = 8
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    progress: bool = True


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr (the seed's 'warmup + cosine')."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def novel_data(kind: str = "char", bpe_vocab: int = 4096, val_chapters: int = 8):
    """(tokenizer, train ids, val ids) for 红楼梦; the tokenizer is trained once and cached."""
    train_text, val_text = corpus.train_val_split(corpus.load_novel(), val_chapters)
    tok = tokenizer.build(train_text, kind, bpe_vocab, CACHE_DIR / "tokenizers")
    as_ids = lambda text: torch.tensor(tok.encode(text), dtype=torch.long)  # noqa: E731
    return tok, as_ids(train_text), as_ids(val_text)


def build_model(config: GPTConfig, seed: int, group: dist.ProcessGroup | None = None) -> TPGPT:
    """The same dense initialisation on every rank (same seed), sharded over `group`."""
    torch.manual_seed(seed)
    return TPGPT(DenseGPT(config), group).to(device())


def count_parameters(config: GPTConfig) -> int:
    """Parameters of the dense model (built on the meta device: no memory, no RNG use)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DenseGPT(config).parameters())


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model: TPGPT, ids: torch.Tensor, cfg: TrainConfig, batches: int) -> float:
    """Mean loss over `batches` fixed batches (the same on every rank and every call)."""
    model.eval()
    seq = model.config.seq_len
    losses = []
    for i in range(batches):
        x, y = packed_batch(ids, cfg.batch, seq, step=i, seed=cfg.seed + 1)
        losses.append(model(x.to(device()), y.to(device())).item())
    model.train()
    return sum(losses) / len(losses)


def train_step(model: TPGPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               step: int, cfg: TrainConfig) -> tuple[float, float]:  # fmt: skip
    """One optimizer step; returns (loss, gradient norm before clipping)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    loss = model(x, y, step=step)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    model.sync_grads()
    norm = model.grad_norm()
    if cfg.grad_clip > 0:
        scale = (cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
    opt.step()
    return loss.item(), norm.item()


def train(config: GPTConfig, cfg: TrainConfig, train_ids: torch.Tensor, val_ids: torch.Tensor,
          out: str | None = None, tok: object | None = None) -> dict:  # fmt: skip
    """Train on every rank of the default group (tp = world size); return a summary dict."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    model = build_model(config, cfg.seed)
    opt = make_optimizer(model, cfg)
    history: list[dict] = []
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), disable=not (cfg.progress and rank == 0), desc=f"train tp={tp}")
    for step in bar:
        x, y = packed_batch(train_ids, cfg.batch, config.seq_len, step, cfg.seed)
        loss, norm = train_step(model, opt, x.to(device()), y.to(device()), step, cfg)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}")
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            val = evaluate(model, val_ids, cfg, cfg.eval_batches)
            history.append(
                {"step": step + 1, "train_loss": loss, "val_loss": val, "grad_norm": norm}
            )
            if rank == 0 and cfg.progress:
                bar.write(f"step {step + 1:>5}: train loss {loss:.4f}  val loss {val:.4f}")
    seconds = time.perf_counter() - start
    summary = {
        "final_train_loss": losses[-1] if losses else None,
        "final_val_loss": history[-1]["val_loss"] if history else None,
        "tokens_per_second": cfg.steps * cfg.batch * config.seq_len / seconds if seconds else None,
        "parameters_per_rank": sum(p.numel() for p in model.parameters()),
        "parameters_total": count_parameters(config),
        "tp": tp,
        "losses": losses,
        "history": history,
        "settings": {"model": config.to_dict(), "train": asdict(cfg)},
    }
    if out is not None:
        save_model(model, cfg, out, tok)
    return summary


def save_model(model: TPGPT, cfg: TrainConfig, out: str | Path, tok: object | None) -> None:
    """Gather the dense weights (collective) and write them atomically from rank 0."""
    state = model.gather_state_dict()
    if dist.get_rank() != 0:
        return
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, tmp / "model.safetensors")
    meta = {"model": model.config.to_dict(), "train": asdict(cfg), "format": "tpedu-dense-1"}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    if tok is not None:
        tok.save(tmp / "tokenizer.json")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def load_model_files(path: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor], object]:
    """(config, dense state dict, tokenizer) from a directory written by `save_model`."""
    path = Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).exists():
            raise FileNotFoundError(
                f"{path / name} is missing: is {path} a model saved by `tpedu train --out`?"
            )
    meta = json.loads((path / "config.json").read_text())
    config = GPTConfig(**meta["model"])
    return config, load_file(path / "model.safetensors"), tokenizer.load(path / "tokenizer.json")


@torch.no_grad()
def generate(config: GPTConfig, state: dict[str, torch.Tensor], prompt_ids: list[int], max_new_tokens: int,
             temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> list[int]:  # fmt: skip
    """Continue `prompt_ids` on every rank of the TP group; every rank returns the same ids.

    Sampling never looks at one shard's logits alone (that picks the wrong token): it uses the
    vocab-parallel sampler, with the same generator seed on every rank.
    """
    model = TPGPT.from_state_dict(config, state).to(device())
    model.eval()
    gen = torch.Generator(device=device()).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device())
    for _ in range(max_new_tokens):
        logits = model(ids[:, -config.seq_len :])[:, -1]  # [1, Vp/t] (or [1, V] if replicated)
        if config.vocab_parallel:
            nxt = vocab_parallel_sample(logits, config.vocab_size, gen, temperature, top_k)
        else:
            nxt = sample(logits, gen, temperature, top_k)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0].tolist()

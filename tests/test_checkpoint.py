"""Sharded checkpoints: the sharding rules equal the model's, a (tp, pp, dp) grid of save ->
load-elsewhere -> next step, exact resume, atomic saves under crashes, clear load errors, the
offline reshard / export tools and the CLI.

Everything runs in float64 so equalities are sharp. Loading is pure copying (merge shards, cut
new ones): loaded weights and AdamW moments are compared with 0.0 tolerance. A step at another
layout reorders sums (TP all-reduces, micro-batches, the DP average): about 1e-16 relative per
operation; AdamW's division by sqrt(v) amplifies it where v is tiny, so the next step's weights
are compared at 1e-9 relative to the tensor's scale (a wrong shard or a lost moment moves them by
>= 1e-4).
"""

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tpedu import checkpoint, launch
from tpedu.checkpoint import writer
from tpedu.checkpoint.files import CheckpointError
from tpedu.launcher import RankError
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.state import shard_map
from tpedu.parallel.config import ParallelConfig
from tpedu.train.config import TrainConfig
from tpedu.train.loop import train

V = 41  # prime: the vocab-parallel table is padded at tp = 2 (42 rows) and 4 (44)
# Tied embeddings (+ the last stage's copy at pp > 1), biases, learned positions, and GQA with a
# single KV head: replicated on both ranks at tp = 2. Every sharding kind appears.
CONFIG = GPTConfig.gpt2_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1)
UNTIED = GPTConfig.llama_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=4, n_kv_heads=2)
CFG = TrainConfig(steps=3, batch=4, lr=1e-2, warmup=1, eval_every=0, grad_clip=0.05, progress=False)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (400,), generator=g), torch.randint(0, V, (100,), generator=g)


def cfg(**kw):
    return TrainConfig(**{**CFG.__dict__, **kw})


def max_rel(a: dict, b: dict) -> tuple[float, str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    worst = max(
        ((a[k] - b[k]).abs().max().item() / max(b[k].abs().max().item(), 1e-30), k) for k in b
    )
    return worst


# ------------------------------------------------------------------ sharding rules == the model's


def _rules_worker(configs):
    torch.set_default_dtype(torch.float64)
    tp, rank = dist.get_world_size(), dist.get_rank()
    worst = 0.0
    for config in configs:
        torch.manual_seed(1)
        dense = DenseGPT(config)
        state = dense.state_dict()
        model = TPGPT(dense)
        params = shard_map(model)
        assert {e.name for e in params if not e.tied_copy} == set(state)
        for name, p in ((e.name, e.param) for e in params):
            kind = checkpoint.param_kind(name, config)
            mine = checkpoint.split_tensor(state[name], kind, tp, rank, config)
            worst = max(worst, (mine - p.detach()).abs().max().item())  # the model's own shard
            shards = [checkpoint.split_tensor(state[name], kind, tp, r, config) for r in range(tp)]
            back = checkpoint.merge_shards(shards, kind, config, state[name].shape[0])
            assert torch.equal(back, state[name]), f"{name} ({kind}) does not merge back"
    return worst


def test_split_matches_the_model_and_merge_inverts_it():
    # tp 2: KV head replicated (1 KV head) and split (2); tp 4: vocab padded to 44, qkv 1 head.
    llama4 = GPTConfig.llama_like(V, seq_len=8, n_layers=1, hidden=16, n_heads=4, n_kv_heads=2)
    for tp, configs in ((2, [CONFIG, UNTIED]), (4, [UNTIED, llama4])):
        worst = max(launch(_rules_worker, tp, configs))
        assert worst == 0.0, f"tp={tp}: max |split_tensor - model shard| = {worst:.1e}"


# --------------------------------------------------------------------------------- the grid

# (tp, pp, dp, zero1), ≤ 4 ranks each: plain DP (replicas write nothing) and DP with ZeRO-1
# (the dp ranks share the writing: each tensor and its optimizer state once).
GRID = [
    (1, 1, 1, False),
    (2, 1, 1, False),
    (1, 2, 1, False),
    (2, 2, 1, False),
    (1, 1, 2, False),
    (2, 1, 2, True),
]


def _train_3d_f64(config, c, tp, pp, dp, zero):
    torch.set_default_dtype(torch.float64)
    tr, va = data()
    return train(config, c, tr, va, parallel=ParallelConfig(tp, pp, dp, zero=int(zero)))


def _resume_all(config, jobs, tp, pp, dp, zero):
    """At one target layout: resume each source checkpoint, run step 2, save step 3."""
    return [_train_3d_f64(config, c, tp, pp, dp, zero)["losses"] for c in jobs]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    ref = launch(
        _train_3d_f64, 1, CONFIG, cfg(ckpt_dir=str(root / "ref"), save_every=2), 1, 1, 1, False
    )[0]
    for lay in GRID:
        tp, pp, dp, zero = lay
        c = cfg(steps=2, ckpt_dir=str(root / f"src{lay}"))
        launch(_train_3d_f64, tp * pp * dp, CONFIG, c, tp, pp, dp, zero)
    return root, ref


def test_grid_save_anywhere_load_anywhere(grid):
    root, ref = grid
    _, want, _ = checkpoint.read_dense(root / "ref" / "step_00000003")
    for target in GRID:
        tp, pp, dp, zero = target
        sources = [s for s in GRID if s != target]
        jobs = [
            cfg(resume=str(root / f"src{s}"), ckpt_dir=str(root / f"{s}to{target}"))
            for s in sources
        ]
        losses = launch(_resume_all, tp * pp * dp, CONFIG, jobs, tp, pp, dp, zero)[0]
        for s, got in zip(sources, losses, strict=True):
            label = f"{s} -> {target}"
            assert len(got) == 1, label  # resumed at step 2: one step left
            # the loss at step 2 is the loaded model's forward: the same logits
            assert got[0] == pytest.approx(ref["losses"][2], rel=1e-12), label
            _, have, index = checkpoint.read_dense(root / f"{s}to{target}")
            assert index["step"] == 3 and index["layout"]["tp"] == tp, label
            # the next optimizer step: weights and AdamW moments (and its step count)
            worst, key = max_rel(have, want)
            assert worst < 1e-9, f"{label}: {key} differs by {worst:.1e} (relative)"


def test_loaded_tensors_are_bit_identical_after_offline_reshard(grid, tmp_path):
    root, _ = grid
    _, src, _ = checkpoint.read_dense(root / f"src{GRID[3]}")  # saved at (2, 2, 1)
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        out = checkpoint.reshard(root / f"src{GRID[3]}", tmp_path / f"{tp}{pp}", tp, pp)
        _, got, index = checkpoint.read_dense(out)
        assert index["layout"]["tp"] == tp and index["layout"]["pp"] == pp
        assert sorted(got) == sorted(src)
        for k in src:
            assert torch.equal(got[k], src[k]), f"({tp}, {pp}) {k}"


def test_the_writing_is_spread_over_the_replicas_with_or_without_zero(grid):
    """One rule, read from the placements: each tensor is written once, by one of the ranks
    holding a copy; the DP replicas share the writing (ZeRO or not), tp rank 0 writes the
    replicated tensors."""
    root, _ = grid
    step_dir, index = checkpoint.read_index(root / f"src{GRID[5]}")  # (2, 1, 2) ZeRO-1
    every = {f"tp{t}-pp0-dp{d}.safetensors" for t in (0, 1) for d in (0, 1)}
    for prefix in ("exp_avg/", ""):  # optimizer state, parameters
        wanted = [e for k, e in index["tensors"].items() if ("/" in k) == bool(prefix)]
        assert {s["file"] for e in wanted for s in e["shards"]} == every, prefix
    for key, e in index["tensors"].items():  # each tensor's shards once: replicas write nothing
        files = [s["file"] for s in e["shards"]]
        assert len(files) == len(set(files)) == (1 if e["kind"] == "replicated" else 2), key
    _, plain = checkpoint.read_index(root / f"src{GRID[4]}")  # (1, 1, 2) without ZeRO
    assert set(plain["files"]) == {"tp0-pp0-dp0.safetensors", "tp0-pp0-dp1.safetensors"}
    assert all(len(e["shards"]) == 1 for e in plain["tensors"].values())  # each once
    assert index["tokens_seen"] == 2 * CFG.batch * CONFIG.seq_len and index["step"] == 2
    assert (step_dir.parent / "latest").read_text().strip() == "step_00000002"


def test_untied_swiglu_gqa_from_tp_to_pipeline_zero1(tmp_path):
    """Llama-like (untied vocab-parallel head, SwiGLU `up`, RMSNorm, no biases): tp 2 -> pp 2 ×
    dp 2 with ZeRO-1, the same checks as the grid."""
    ref = launch(_train_3d_f64, 1, UNTIED, cfg(ckpt_dir=str(tmp_path / "ref")), 1, 1, 1, False)[0]
    launch(_train_3d_f64, 2, UNTIED, cfg(steps=2, ckpt_dir=str(tmp_path / "src")), 2, 1, 1, False)
    c = cfg(resume=str(tmp_path / "src"), ckpt_dir=str(tmp_path / "dst"))
    got = launch(_train_3d_f64, 4, UNTIED, c, 1, 2, 2, True)[0]["losses"]
    assert got[0] == pytest.approx(ref["losses"][2], rel=1e-12)
    _, want, _ = checkpoint.read_dense(tmp_path / "ref")
    _, have, _ = checkpoint.read_dense(tmp_path / "dst")
    assert "lm_head.weight" in have and "exp_avg/blocks.1.mlp.up.weight" in have
    worst, key = max_rel(have, want)
    assert worst < 1e-9, f"{key} differs by {worst:.1e} (relative)"


# ------------------------------------------------------------------------------ exact resume


def _train_f64(config, c):
    torch.set_default_dtype(torch.float64)
    tr, va = data()
    return train(config, c, tr, va)["losses"]


def test_exact_resume_same_layout_bit_identical_with_dropout(tmp_path):
    """2N steps == N steps, save, resume, N more: the same floats, dropout on (its masks are a
    function of (seed, step, index): the step counter is the RNG state)."""
    config = GPTConfig.gpt2_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2, dropout=0.2)
    c = cfg(steps=4, ckpt_dir=str(tmp_path), save_every=2)
    full = launch(_train_f64, 2, config, c)[0]
    resumed = launch(_train_f64, 2, config, cfg(steps=4, resume=str(tmp_path / "step_00000002")))
    assert resumed[0] == full[2:], f"resumed {resumed[0]} vs uninterrupted {full[2:]}"
    # a different dropout seed gives different losses: the seed is really in play
    other = GPTConfig(**{**config.to_dict(), "seed": 1})
    assert launch(_train_f64, 1, other, cfg(steps=1))[0][0] != full[0]
    # at another layout (tp 1 from tp 2) the same masks: equal up to reordered sums
    at_tp1 = launch(_train_f64, 1, config, cfg(steps=4, resume=str(tmp_path / "step_00000002")))[0]
    assert at_tp1 == pytest.approx(full[2:], rel=1e-12)


# ----------------------------------------------------------------------- crashes and damage


def _save_twice_crash_second(root, crash):
    """Save step 1 cleanly, then crash rank 1 in the middle of writing step 2."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(CONFIG))
    checkpoint.save(root, model, None, 1)
    if dist.get_rank() == 1:
        real = writer.write_synced

        def half(path, data):
            real(path, data[: len(data) // 2])  # a partial file on disk ...
            if crash == "kill":
                os._exit(3)  # ... and the process dies (kill -9, OOM, node loss)
            raise OSError(28, "No space left on device")

        writer.write_synced = half  # the shard writer's own reference
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.add_(1.0)
    checkpoint.save(root, model, None, 2)


def _load_worker(root):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TPGPT(DenseGPT(CONFIG))
    want = model.gather_state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    index = checkpoint.load(root, model)
    got = model.gather_state_dict()
    return index["step"], max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("crash", ["raise", "kill"])
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, crash):
    with pytest.raises(
        RankError, match="No space left" if crash == "raise" else "exited with code 3"
    ):
        launch(_save_twice_crash_second, 2, tmp_path, crash, timeout=30)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()
    assert (tmp_path / ".tmp-step_00000002").exists()  # the wreck, ignored by load
    for step, diff in launch(_load_worker, 2, tmp_path):
        assert step == 1 and diff == 0.0


def _bad_load(path, config):
    torch.set_default_dtype(torch.float64)
    model = TPGPT(DenseGPT(config))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        checkpoint.load(path, model)
    except CheckpointError as e:
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return str(e), unchanged
    return "loaded", True


@pytest.fixture()
def good(tmp_path):
    def worker():
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        checkpoint.save(tmp_path / "ck", TPGPT(DenseGPT(CONFIG)), None, 5)

    launch(worker, 2)
    return tmp_path / "ck" / "step_00000005"


def _damage(step_dir, how):
    f = step_dir / "tp1-pp0-dp0.safetensors"
    if how == "missing":
        f.unlink()
    elif how == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "corrupted":  # same size, one byte flipped
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    elif how == "index":
        (step_dir / "index.json").write_text("{ not json")
    elif how == "shape":
        index = json.loads((step_dir / "index.json").read_text())
        index["tensors"]["blocks.0.mlp.fc1.weight"]["shape"] = [32, 16]
        (step_dir / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing", r"tp1-pp0-dp0.safetensors is missing"),
        (
            "truncated",
            r"tp1-pp0-dp0.safetensors is truncated .*'files.tp1-pp0-dp0.safetensors.bytes'",
        ),
        ("corrupted", r"tp1-pp0-dp0.safetensors is corrupted.*sha256"),
        ("index", r"index.json is not valid JSON"),
        (
            "shape",
            r"'tensors.blocks.0.mlp.fc1.weight.shape' is \[32, 16\], the model needs \[64, 16\]",
        ),
    ],
)
def test_damaged_checkpoints_are_clear_errors_and_load_nothing(good, how, message):
    _damage(good, how)
    results = launch(_bad_load, 2, good, CONFIG)
    assert all(unchanged for _, unchanged in results), "a failed load changed the model"
    texts = [text for text, _ in results]  # a rank that found it names it; others say so
    assert any(re.search(message, t) for t in texts), texts
    assert all(re.search(message, t) or "remote worker" in t for t in texts), texts


def test_wrong_config_names_the_field(good):
    wider = GPTConfig(**{**CONFIG.to_dict(), "ffn_hidden": 32})
    text, unchanged = launch(_bad_load, 1, good, wider)[0]
    assert unchanged and "field 'model.ffn_hidden' is None" in text and "ffn_hidden=32" in text
    text, _ = launch(_bad_load, 1, good.parent / "nowhere", CONFIG)[0]
    assert "nowhere does not exist" in text


# --------------------------------------------------------------------- export, import, CLI


def test_export_dense_and_hf_and_import(grid, tmp_path):
    root, _ = grid
    src_dir = root / f"src{GRID[2]}"  # (1, 2, 1): the tensors come from two pipeline stages
    _, src, _ = checkpoint.read_dense(src_dir)
    params = {k: v for k, v in src.items() if "/" not in k}
    dense_dir = checkpoint.export_dense(src_dir, tmp_path / "dense")
    meta = json.loads((dense_dir / "config.json").read_text())
    assert GPTConfig(**meta["model"]) == CONFIG
    state = load_file(dense_dir / "model.safetensors")
    assert sorted(state) == sorted(params) and all(torch.equal(state[k], params[k]) for k in state)
    back = checkpoint.import_dense(dense_dir, tmp_path / "back", tp=2, pp=2)
    _, again, index = checkpoint.read_dense(back)
    assert index["step"] == 0 and all(torch.equal(again[k], params[k]) for k in params)
    transformers = pytest.importorskip("transformers")
    # HF GPT-2 needs plain multi-head attention: a GPT-2-shaped model saved at (2, 2) offline
    gpt2 = GPTConfig.gpt2_like(V, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    torch.manual_seed(0)
    dense = DenseGPT(gpt2).double()
    ck = checkpoint.write_sharded(
        tmp_path / "g", gpt2, dense.state_dict(), 7, ParallelConfig(tp=2, pp=2)
    )
    hf = transformers.GPT2LMHeadModel.from_pretrained(checkpoint.export_hf(ck, tmp_path / "hf"))
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    diff = (hf.double().eval()(ids).logits - dense(ids)).abs().max().item()
    assert diff < 1e-12, f"max |HF - tpedu| logits = {diff:.1e}"


def test_cli_reshard(grid, tmp_path, capsys):
    from tpedu.cli.commands import main

    src = grid[0] / f"src{GRID[0]}"
    assert main(["reshard", str(src), "--tp", "2", "--pp", "2", "--out", str(tmp_path / "r")]) == 0
    assert "step 2, tp=2 pp=2 dp=1, 4 shard files" in capsys.readouterr().out
    _, a, _ = checkpoint.read_dense(src)
    _, b, _ = checkpoint.read_dense(tmp_path / "r")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit) as e:
        main(["reshard", str(src), "--tp", "3", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "not divisible by tp=3; valid tp values: 1, 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["reshard", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert "nothing does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_train_resume_at_another_layout(tmp_path, capsys):
    """`train --tp 2 --ckpt-dir` then `train --tp 1 --pp 2 --resume`: the resumed losses continue
    the uninterrupted run's (float32 CLI training: reordered sums, ~1e-7 relative per step)."""
    from tpedu.cli.commands import main

    small = "--layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 4 --eval-every 0".split()
    ck, j1, j2 = tmp_path / "ck", tmp_path / "a.json", tmp_path / "b.json"
    assert (
        main(
            [
                "train",
                "--tp",
                "2",
                *small,
                "--ckpt-dir",
                str(ck),
                "--save-every",
                "2",
                "--json",
                str(j1),
            ]
        )
        == 0
    )
    assert {p.name for p in ck.iterdir()} == {"latest", "step_00000002", "step_00000004"}
    resume = ["--resume", str(ck / "step_00000002"), "--json", str(j2)]
    assert main(["train", "--tp", "1", "--pp", "2", *small, *resume]) == 0
    capsys.readouterr()
    full, resumed = (json.loads(j.read_text())["losses"] for j in (j1, j2))
    assert resumed == pytest.approx(full[2:], rel=1e-5)
    with pytest.raises(SystemExit):
        main(["train", "--tp", "1", *small, "--save-every", "2"])
    assert "--save-every needs --ckpt-dir" in capsys.readouterr().err

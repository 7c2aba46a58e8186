"""Grades exercises/l07_tp_block.py: a tensor-parallel block assembled from tpedu's layers.

Every rank builds the same DenseBlock (float64, dropout 0.1 on, random norm weights so swapping
norm1 and norm2 shows), shards it with the learner's TPBlock, and runs one forward and backward
with the same input and output gradient. Compared with the DenseBlock: the output, dL/dx, and
every parameter gradient in the dense layout (gathered through the tpedu layers' helpers); then
the output in eval mode (.eval(): no dropout anywhere).

Tolerance 1e-11 absolute: in float64 the only differences are sums reordered by the row-parallel
all-reduces (≈1e-16 relative each) on values of magnitude <= ~50; a missing dropout, a wrong
step, a shared (not copied) norm or a missing residual changes results by >= 1e-3.

tpedu's own block (tpedu.model.gpt.TPBlock) refuses to run while the learner's code does, so a
wrapper or an alias of it fails.
"""

import pytest
import torch
import torch.distributed as dist

import tpedu
from tests.exercises import refusing
from tpedu.comm.tracer import CommTracer
from tpedu.course.grading import implementation
from tpedu.model import gpt
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseBlock

NAME = "l07_tp_block"
TWINS = (gpt.TPBlock.__init__, gpt.TPBlock.forward)
TOL = 1e-11
B, S = 3, 7  # uneven on purpose

# 12 heads, ffn 192: splits at tp 1, 2, 3, 4. GELU-tanh, LayerNorm with bias, biases everywhere.
GPT2 = GPTConfig.gpt2_like(37, seq_len=16, hidden=48, n_heads=12, dropout=0.1, seed=5)
# GQA (2 KV heads: split at tp 2, replicated at tp 4), RoPE, RMSNorm, SwiGLU, no biases.
LLAMA = GPTConfig.llama_like(37, seq_len=16, hidden=32, n_heads=4, dropout=0.1, seed=6)


def _dense_grads(dense: DenseBlock) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in dense.named_parameters()}


def _tp_grads(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's gradients in DenseBlock's layout and names (collective: all-gathers)."""
    out = {f"norm1.{n}": p.grad for n, p in block.norm1.named_parameters()}
    out |= {f"norm2.{n}": p.grad for n, p in block.norm2.named_parameters()}
    attn, mlp = block.attn, block.mlp
    out["attn.qkv.weight"] = attn.dense_qkv_weight(grad=True)
    out["attn.qkv.bias"] = attn.dense_qkv_bias(grad=True)
    out["attn.out.weight"] = attn.out.dense_weight(grad=True)
    out["attn.out.bias"] = attn.out.dense_bias(grad=True)
    for name in ("fc1", "up", "fc2"):
        layer = getattr(mlp, name)
        if layer is not None:
            out[f"mlp.{name}.weight"] = layer.dense_weight(grad=True)
            out[f"mlp.{name}.bias"] = layer.dense_bias(grad=True)
    return {k: v for k, v in out.items() if v is not None}


@refusing(*TWINS)
def _worker(config: GPTConfig, step: int) -> dict:
    m = implementation(NAME)
    torch.manual_seed(0)
    dense = DenseBlock(config, layer=1).double()
    with torch.no_grad():  # non-trivial norms: norm1 and norm2 must not be interchangeable
        for p in [*dense.norm1.parameters(), *dense.norm2.parameters()]:
            p.add_(torch.randn_like(p) * 0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, config.hidden, generator=g, dtype=torch.float64).to(tpedu.device())
    dy = torch.randn(B, S, config.hidden, generator=g, dtype=torch.float64).to(tpedu.device())

    # Built on the CPU (the same init on every rank), then moved to this rank's device. The block
    # is built first: a norm shared with `dense` gets both gradients.
    block = m.TPBlock(dense, None).to(tpedu.device())
    dense.to(tpedu.device())
    xd = x.clone().requires_grad_()
    yd = dense(xd, step)
    (yd * dy).sum().backward()
    dense_grads = _dense_grads(dense)  # a snapshot: a shared norm would add the TP gradient to it
    with CommTracer() as trace:
        xt = x.clone().requires_grad_()
        yt = block(xt, step)
        (yt * dy).sum().backward()
    block.attn.all_reduce_replicated_kv_grads()  # GQA with tp > n_kv_heads: replicas' partials
    with torch.no_grad():  # eval mode: every dropout (attention, its output, MLP) switches off
        ye = dense.eval()(x, step)
        yte = block.eval()(x, step)

    diffs = {
        "output": (yt - yd).abs().max().item(),
        "dL/dx": (xt.grad - xd.grad).abs().max().item(),
        "eval-mode output": (yte - ye).abs().max().item(),
    }
    tp_grads = _tp_grads(block)
    if tp_grads.keys() != dense_grads.keys():
        raise AssertionError(f"gradients {sorted(tp_grads)} != dense {sorted(dense_grads)}")
    diffs |= {f"grad {k}": (tp_grads[k] - dense_grads[k]).abs().max().item() for k in dense_grads}
    return {
        "diffs": diffs,
        "calls": [(r.op, r.phase, r.numel) for r in trace.records],
        "params": sum(p.numel() for p in block.parameters()),
        "dense_params": sum(p.numel() for p in dense.parameters()),
        "tp": dist.get_world_size(),
        "dropout_changes_output": (ye - yd).abs().max().item(),
    }


def _check_equal(config: GPTConfig, tp: int) -> list[dict]:
    out = tpedu.launch(_worker, tp, config, 3)
    for rank, r in enumerate(out):
        bad = {k: d for k, d in r["diffs"].items() if not d < TOL}  # NaN fails too
        assert not bad, (
            f"tp={tp} rank {rank}: max |tp - dense| "
            + ", ".join(f"of {k} = {d:.3e}" for k, d in bad.items())
            + f" (tolerance {TOL:.0e})"
        )
        # not vacuous: the training-mode output has dropout, the eval-mode one does not
        assert r["dropout_changes_output"] > 1e-3
    return out


def _check_contract(out: list[dict], hidden: int) -> None:
    n = B * S * hidden
    for rank, r in enumerate(out):
        expected = [("all_reduce", "forward", n)] * 2 + [("all_reduce", "backward", n)] * 2
        assert r["calls"] == expected, (
            f"rank {rank}: expected 2 all-reduces of b·s·H = {n} elements forward and 2 backward "
            f"(and nothing else); got (op, phase, numel) = {r['calls']}"
        )


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_block_equals_dense(tp):
    """Forward, dL/dx and all parameter gradients equal the DenseBlock's, dropout on."""
    _check_equal(GPT2, tp)


def test_communication_contract_and_sharding():
    """tp=2: exactly 2 all-reduces of b·s·H forward and 2 backward; attention and MLP are split."""
    out = _check_equal(GPT2, 2)
    _check_contract(out, GPT2.hidden)
    h, f = GPT2.hidden, GPT2.ffn
    replicated = 4 * h + h + h  # two LayerNorms (weight, bias), the out-projection and fc2 biases
    split = (3 * h * h + 3 * h) + h * h + (h * f + f) + f * h  # qkv, out weight, fc1, fc2 weight
    assert out[0]["dense_params"] == replicated + split
    assert out[0]["params"] == replicated + split // 2, (
        f"per-rank parameters {out[0]['params']}, expected {replicated + split // 2}: "
        "attention and MLP weights must be sharded, norms replicated"
    )


def test_gqa_llama_block():
    """RMSNorm, RoPE, SwiGLU, 2 KV heads: split at tp=2, replicated at tp=4; same contract."""
    for tp in (2, 4):
        _check_contract(_check_equal(LLAMA, tp), LLAMA.hidden)

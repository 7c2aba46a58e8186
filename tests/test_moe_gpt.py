"""A GPT whose MLPs are mixtures of experts: the tensor-parallel model equals DenseGPT forward and
backward (the auxiliary losses' gradients included), and expert-parallel training (ep carved
from DP, with TP and PP around it) equals one process step by step; the CLI's flags and errors.

float64 throughout. The model test: 1e-12 absolute, as tests/test_mlp.py argues (TP reorders
sums: ~1e-15 relative; a wrong split, weight or aux gradient is O(1e-3) or more). Training:
F64 (1e-10 relative after 3 AdamW steps, tests/helpers.py).

What must equal one process, and why some runs leave the auxiliary losses out: the
load-balancing loss E·Σ f·P is not a sum over tokens, so it equals the one-process value only
when one EP group sees the whole global batch at once (dp = ep, one micro-batch). Capacity
drops among each rank's tokens, so the training runs are dropless; the model test drops.
"""

import dataclasses

import pytest
import torch

from tests.helpers import CFG, F64, V, check, cli, data, f64, one_line_error
from tpedu import checkpoint, launch
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.moe.aux_loss import aux_loss_scale
from tpedu.parallel.config import ParallelConfig
from tpedu.train.loop import train

TOL = 1e-12
SHAPE = {"seq_len": 8, "n_layers": 2, "hidden": 16, "n_heads": 4}
MOE = GPTConfig.gpt2_like(V, **SHAPE, experts=4, top_k=2, z_loss_coef=1e-3)
# Llama-style: SwiGLU experts, top-1 without renormalising, a shared expert, every 2nd layer
LLAMA_MOE = GPTConfig.llama_like(
    V, **SHAPE, n_kv_heads=1, experts=4, top_k=1, moe_every=2, shared_expert=True,
    router_renormalize=False, z_loss_coef=1e-3,
)  # fmt: skip
DROPPING = dataclasses.replace(MOE, capacity_factor=0.5)
NO_AUX = dataclasses.replace(MOE, aux_loss_coef=0.0, z_loss_coef=0.0)


def model_worker(config):
    """TPGPT (this rank's shards) against DenseGPT on one batch: the loss, every dense-layout
    gradient, the routing statistics of the MoE layers."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    dense = DenseGPT(config)
    model = TPGPT(dense)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, config.seq_len), generator=g)
    ld, lm = dense(ids, ids), model(ids, ids)
    ld.backward()
    lm.backward()
    model.sync_grads()  # the replicated KV heads' sum (llama: 1 KV head over tp 2)
    grads = model.gather_state_dict(grads=True)
    want = {n: p.grad for n, p in dense.named_parameters()}
    moe = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
    stats = [(dense.blocks[i].moe_stats, model.blocks[i].moe_stats) for i in moe]
    return {
        "loss": abs(ld - lm).item(),
        "keys": sorted(grads) == sorted(want),
        "grad": max((grads[n] - want[n]).abs().max().item() for n in want),
        "router_grad": min(want[f"blocks.{i}.mlp.router.gate.weight"].abs().max() for i in moe),
        "aux": max(abs(d.aux_loss - t.aux_loss).item() for d, t in stats),
        "counts": all(torch.equal(d.tokens_per_expert, t.tokens_per_expert) for d, t in stats),
        "dropped": [d.dropped for d, _ in stats],
    }


@pytest.mark.parametrize("config", [MOE, LLAMA_MOE, DROPPING], ids=["gpt2", "llama", "dropping"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_moe_gpt_equals_the_dense_one(config, tp):
    """Each expert column/row split over TP, the router replicated: loss and every gradient."""
    for r in launch(model_worker, tp, config):
        assert r["keys"] and r["counts"]
        assert r["loss"] < TOL and r["grad"] < TOL and r["aux"] < TOL
        assert r["router_grad"] > 1e-6  # the routers learn (through the weights and aux)
        assert all(d > 0 for d in r["dropped"]) == (config is DROPPING)


def test_the_auxiliary_losses_reach_the_router():
    """The aux terms' gradient reaches the routers (without them it differs), and TP == dense
    holds at any coefficient."""
    with_aux = launch(model_worker, 1, MOE)[0]
    without = launch(model_worker, 1, NO_AUX)[0]
    assert with_aux["router_grad"] != without["router_grad"]
    r = launch(model_worker, 2, dataclasses.replace(MOE, aux_loss_coef=1.0, z_loss_coef=0.1))
    assert max(x["grad"] for x in r) < TOL


def run(config, layout, cfg=CFG, **kw):
    tr, va = data()
    parallel = ParallelConfig(*layout, **kw)
    return launch(f64, parallel.world, train, config, cfg, tr, va, parallel=parallel)


@pytest.fixture(scope="module")
def one_process():
    tr, va = data()
    return {name: launch(f64, 1, train, c, CFG, tr, va)[0] for name, c in REF.items()}


REF = {"aux": MOE, "no aux": NO_AUX}


@pytest.mark.parametrize(
    "ref, layout, cp",
    [
        ("aux", (1, 1, 2), 1),  # ep 2 = dp 2: one EP group holds the whole batch
        ("aux", (2, 1, 2), 1),  # ep 2 × tp 2: each expert split over TP too
        ("no aux", (1, 1, 4), 1),  # ep 2 × edp 2: experts reduced over the edp group
        ("no aux", (1, 2, 2), 1),  # ep 2 × pp 2: micro-batches through two stages
        ("no aux", (1, 1, 2), 2),  # ep 2 × cp 2: each CP rank routes its own positions
    ],
)
def test_expert_parallel_training_equals_one_process(one_process, ref, layout, cp):
    """ep 2 carved from DP: losses, gradient norms, validation losses of every step."""
    results = run(REF[ref], layout, ep=2, cp=cp)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    check(results[0], one_process[ref], f"ep 2 {layout}", rel=F64)
    assert one_process["aux"]["losses"][-1] != one_process["no aux"]["losses"][-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "2", "--ep", "2"], "ep = 2 needs a mixture of experts to split"),
        (["--experts", "4", "--dp", "4", "--ep", "3"], "ep = 3 does not divide dp = 4"),
        (["--experts", "6", "--dp", "4", "--ep", "4"], "experts = 6 is not divisible by ep = 4"),
        (["--experts", "4", "--top-k", "3"], "top_k = 3 is not supported"),
        (["--experts", "4", "--dp", "2", "--ep", "2", "--out", "x"], "--to dense --out DIR"),
        (["--experts", "4", "--sequence-parallel", "--tp", "2"], "sequence parallelism with"),
    ],
)
def test_bad_moe_flags_are_one_line_errors(capfd, args, message):
    one_line_error(capfd, ["train", "--steps", "1", *args], message)


def test_cli_trains_an_expert_parallel_moe(capfd):
    code, out, err = cli(
        capfd, "train", "--experts", "4", "--dp", "2", "--ep", "2", "--steps", "2",
        "--layers", "1", "--hidden", "32", "--seq", "16", "--batch", "4", "--eval-every", "2",
    )  # fmt: skip
    assert code == 0, err
    assert '"ep": 2' in out and '"experts": 4' in out


def scaled_worker():
    """Gradients of S·loss backpropagated inside aux_loss_scale(S), over those of the loss."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = DenseGPT(MOE)
    ids = torch.randint(0, V, (2, MOE.seq_len), generator=torch.Generator().manual_seed(1))
    model(ids, ids).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with aux_loss_scale(3.0):
        (3.0 * model(ids, ids)).backward()
    return max((p.grad - 3.0 * plain[n]).abs().max().item() for n, p in model.named_parameters())


def test_aux_loss_scale_scales_the_auxiliary_gradients_with_the_loss():
    """A step that backpropagates (loss / m) · S gives the attached auxiliary losses S / m too:
    every gradient, the routers' included, is exactly 3× (a scale left at 1 would not be)."""
    assert launch(scaled_worker, 1)[0] < TOL


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_expert_parallelism_equals_one_process(one_process, zero):
    """ep 2 × edp 2 under ZeRO: the experts' flat buffers sharded over the edp group (2 ranks),
    the rest over dp (4): the same steps as one process."""
    results = run(NO_AUX, (1, 1, 4), ep=2, zero=zero)
    check(results[0], one_process["no aux"], f"ZeRO-{zero} ep 2", rel=F64)


def test_expert_parallel_checkpoints_reshard_to_any_ep(tmp_path):
    """Saved at step 3 of 5 at ep 2 × dp 2 (each EP rank writes its own experts, once: the
    first of their replicas), resumed at ep 1 (dp 2: every expert on every rank), at ep 2 ×
    tp 2 and by one process: each continues like the straight run, step for step."""
    five = dataclasses.replace(CFG, steps=5, eval_every=5)
    tr, va = data()
    straight = launch(f64, 1, train, NO_AUX, five, tr, va)[0]["losses"]
    root = tmp_path / "ep2"
    run(NO_AUX, (1, 1, 4), ep=2, cfg=dataclasses.replace(five, ckpt_dir=str(root), save_every=3))
    _, index = checkpoint.read_index(root / "step_00000003")
    expert = index["tensors"]["blocks.0.mlp.experts.3.fc1.weight"]["shards"]
    assert [s["file"] for s in expert] == ["tp0-pp0-dp1.safetensors"]  # ep rank 1's expert
    resume = dataclasses.replace(five, resume=str(root / "step_00000003"))
    for layout, ep, zero in (((1, 1, 2), 1, 0), ((2, 1, 2), 2, 0), ((1, 1, 1), 1, 0),
                             ((1, 1, 4), 2, 3)):  # fmt: skip
        losses = run(NO_AUX, layout, ep=ep, zero=zero, cfg=resume)[0]["losses"]
        assert losses == pytest.approx(straight[3:], rel=F64), (layout, ep, zero)
    # saved under ZeRO-2 at ep 2, resumed by one process
    root = tmp_path / "ep2zero2"
    cfg = dataclasses.replace(five, ckpt_dir=str(root), save_every=3)
    run(NO_AUX, (1, 1, 4), ep=2, zero=2, cfg=cfg)
    resume = dataclasses.replace(five, resume=str(root / "step_00000003"))
    losses = run(NO_AUX, (1, 1, 1), cfg=resume)[0]["losses"]
    assert losses == pytest.approx(straight[3:], rel=F64)

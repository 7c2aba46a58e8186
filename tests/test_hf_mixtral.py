"""Lesson 18: Hugging Face Mixtral weights in the tensor- and expert-parallel GPT give Mixtral's
own logits and routing at tp 1, tp 2, ep 2 and tp 2 × ep 2, from a state dict or from a
`save_pretrained` directory by slices (each rank reads its experts only); HF -> tpedu -> HF
gives back every tensor; what either side cannot express is refused in one line. Nothing is
downloaded: a tiny, randomly initialised MixtralForCausalLM is built locally.

Tolerances. transformers runs three pieces of a Mixtral in float32 even in a float64 model:
RMSNorm, the RoPE angles (as Llama, tests/test_hf_llama.py) and the router, which takes the
softmax of `logits.float()` and renormalises the top-k weights in float32. `hf64` swaps those
forwards for the same formulas in the input's dtype. What remains is summation order only (the
fused QKV, TP's partial sums; each token's two expert outputs are added to zero, and a + b is
b + a exactly), ~1e-16 relative per reduction: rtol = atol = 1e-12 on logits of size ~0.4.

Unpatched, the float32 router's combine weights are bounded (u = 2^-24, float32's unit
roundoff; L = max |router logit|). The softmax kernel computes e_j = exp(l_j - max) and p_j =
e_j · (1 / Σ e): casting l_j and the max to float32 moves l_j - max by <= 2uL, the subtraction
rounds it by <= 2uL, exp by <= 2u (relative), so each e_j is off by a factor within
exp(±(4L + 2)u). The common 1 / Σ e cancels in w_i = p_i / (p_1 + p_2) but for the roundings of
the products, the sum and the division (<= 4u), and the denominator's relative error is at most
its terms': |Δw| / w <= (8L + 8)·u: 3.7e-6 and 6.2e-6 for these two layers (L = 6.7 and 12),
measured 2.7e-7 and 3.9e-7, checked as such on the very router inputs. The top-k choices cannot
differ: the order of two probabilities is that of e_a (1 + η_a) and e_b (1 + η_b), each off by
<= (4L + 3)·u relative, so it can flip only if they are within 2·(4L + 3)·u (< 7e-6) of each
other; every token's k-th and (k+1)-th are further apart (checked; the closest, 2.9e-4). The
logits, all three islands unpatched: each perturbs an activation by O(10 u) relative, and with
these small weights (std 0.02) the logits move far less: ~3e-8 measured, checked at 1e-6 (as
the Llama test does).
"""

from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers.models.mixtral import modeling_mixtral

from tests.helpers import _CountingFile, cli, one_line_error
from tpedu import launch
from tpedu.checkpoint import hf, hf_map, hf_mixtral
from tpedu.model.config import GPTConfig
from tpedu.model.dense import DenseGPT
from tpedu.model.gpt import TPGPT
from tpedu.model.state import dense_shapes, shard_map, split_tensor
from tpedu.parallel.config import ParallelConfig
from tpedu.parallel.mesh import Mesh

TIGHT = {"rtol": 1e-12, "atol": 1e-12}  # float64, reordered sums only
V, E, K, S = 61, 4, 2, 12  # vocabulary, experts, top-k, tokens per sequence
U = 2.0**-24  # float32's unit roundoff


def _rmsnorm64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary64(self, x, position_ids):
    d = 2 * self.inv_freq.shape[0]
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = position_ids[..., None].double() * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _router64(self, hidden_states):
    """MixtralTopKRouter.forward with the softmax and renormalisation in the input's dtype."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, experts = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), experts


@contextmanager
def hf64():
    """transformers' Mixtral with RMSNorm, RoPE and routing in the input's dtype (module doc)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_mixtral.MixtralRMSNorm, "forward", _rmsnorm64)
        mp.setattr(modeling_mixtral.MixtralRotaryEmbedding, "forward", _rotary64)
        mp.setattr(modeling_mixtral.MixtralTopKRouter, "forward", _router64)
        yield


def tiny_mixtral(**overrides) -> transformers.MixtralConfig:
    fields = {
        "vocab_size": V,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "num_local_experts": E,
        "num_experts_per_tok": K,
        "max_position_embeddings": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},  # not the default
        "router_aux_loss_coef": 0.02,  # not the default either
        "experts_implementation": "eager",  # grouped_mm has no float64 on CPU
    }
    return transformers.MixtralConfig(**{**fields, **overrides})


def scramble(model: torch.nn.Module) -> None:
    """Every bit of float64 in use, norm weights not all 1, and routers 30x sharper than the
    init's (logits of a few units): every token's choice is clear, and every expert gets some."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.add_(1e-3 * torch.randn_like(p))
            if name.endswith(("mlp.gate.weight", "router.gate.weight")):
                p.mul_(30.0)


def hf_run(model, ids, exact=True, **kw):
    """(logits, [per layer: the router's (logits, weights, experts)]) of a transformers run."""
    routes = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: routes.append(o))
        for m in model.modules()
        if isinstance(m, modeling_mixtral.MixtralTopKRouter)
    ]
    try:
        with torch.no_grad(), hf64() if exact else nullcontext():
            out = model(ids, **kw)
    finally:
        for h in hooks:
            h.remove()
    return out, routes


@pytest.fixture(scope="module")
def mixtral():
    """The model, ids [2, S], transformers' float64 logits and each layer's top-k experts.
    One thread, as the tests (conftest's `_one_thread` starts after a module fixture): the
    round trips compare logits bit for bit, and a thread count reorders a matmul's sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(tiny_mixtral()).double().eval()
        scramble(model)
        ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
        out, routes = hf_run(model, ids)
    finally:
        torch.set_num_threads(threads)
    return model, ids, out.logits, [experts for _, _, experts in routes]


def record_routing(model: torch.nn.Module) -> list[torch.Tensor]:
    """The experts [T, k] each of tpedu's routers picks, appended at every forward."""
    from tpedu.moe.router import Router

    picked: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda m, i, o: picked.append(o.experts))
    return picked


def parallel_run(config, state, ids, tp, ep, path=None):
    """On a rank of tp × ep (ep carved from dp = ep): TPGPT from `state` (and, with `path`, from
    the directory by slices, counting the bytes read) fed this EP rank's own sequences."""
    torch.set_default_dtype(torch.float64)  # built in float64: no float32 copy of the weights
    parallel = ParallelConfig(tp=tp, dp=ep, ep=ep)
    mesh = Mesh(parallel.layout)
    options = parallel.model_options(mesh)
    model = TPGPT.from_state_dict(config, state, mesh.tp_group, options=options).eval()
    mine = ids.chunk(ep)[mesh.dp_rank]
    picked = record_routing(model)
    with torch.no_grad():
        logits = model.full_logits(mine)
    out = {"dp_rank": mesh.dp_rank, "logits": logits, "experts": picked}
    out["held"] = sorted({n.split(".")[4] for n, _ in model.named_parameters() if ".experts." in n})
    if path is not None:
        log: list[int] = []

        @contextmanager
        def counting_open(file, framework):
            with safe_open(file, framework) as f:
                yield _CountingFile(f, log)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hf_map, "safe_open", counting_open)
            sliced = hf.load_hf_sharded(path, mesh.tp_group, torch.float64, options).eval()
        rank = mesh.tp_rank
        shapes = dense_shapes(config)
        held = sum(  # zero padding rows of the vocabulary are not read
            split_tensor(torch.ones(shapes[e.name]), e.stored_kind, tp, rank, config).sum()
            for e in shard_map(sliced)
        )
        full = dict(model.named_parameters())
        out["same"] = all(torch.equal(p, full[n]) for n, p in sliced.named_parameters())
        out["same"] &= sliced.state_dict().keys() == model.state_dict().keys()
        out["read"], out["should_read"] = sum(log), int(held) * 8
        with torch.no_grad():
            out["sliced_logits"] = sliced.full_logits(mine)
    return out


def check_ranks(results, ids, expected, hf_experts, ep):
    """Each rank's logits and routing are transformers' on that rank's own sequences."""
    rows = ids.shape[0] // ep
    for r in results:
        d = r["dp_rank"]
        torch.testing.assert_close(r["logits"], expected[d * rows : (d + 1) * rows], **TIGHT)
        assert len(r["experts"]) == len(hf_experts)
        for ours, theirs in zip(r["experts"], hf_experts, strict=True):
            assert torch.equal(ours, theirs[d * rows * S : (d + 1) * rows * S])
        assert len(r["held"]) == E // ep  # each EP rank holds its own experts only
    assert len({tuple(r["held"]) for r in results}) == ep


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, ep); ep 2 carved from dp 2


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS, ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def test_mixtral_weights_give_mixtral_logits_and_routing(mixtral, tp, ep):
    """From transformers' own state dict (experts fused: gate_up_proj, down_proj): the logits,
    and every router's top-k experts for every token, equal transformers'. With EP each rank
    feeds its own sequence, so its tokens cross the all-to-all to the other rank's experts."""
    model, ids, expected, hf_experts = mixtral
    config = hf.config_from_hf(model.config)
    moe = (config.experts, config.top_k, config.moe_every, config.router_renormalize)
    assert moe == (E, K, 1, True) and config.capacity_factor is None
    assert (config.aux_loss_coef, config.z_loss_coef, config.rope_theta) == (0.02, 0.0, 500.0)
    state = hf.state_from_hf(model.state_dict(), config)
    results = launch(parallel_run, tp * ep, config, state, ids, tp, ep)
    check_ranks(results, ids, expected, hf_experts, ep)
    assert all(torch.bincount(x.reshape(-1), minlength=E).min() > 0 for x in hf_experts)


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)], ids=["tp2", "tp2-ep2"])
def test_mixtral_directory_loads_by_slices(mixtral, tmp_path, tp, ep):
    """save_pretrained writes the experts one by one (block_sparse_moe.experts.j.w1/w2/w3): each
    rank reads only its experts' rows or columns (and its heads', its vocabulary rows), exactly
    its shards' bytes, and gets the full load bit for bit."""
    model, ids, expected, hf_experts = mixtral
    model.save_pretrained(tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in files
    total = sum(v.numel() * v.element_size() for v in files.values())
    config = hf.config_from_hf(model.config)
    state = hf.state_from_hf(files, config)  # the files' layout: per expert
    results = launch(parallel_run, tp * ep, config, state, ids, tp, ep, tmp_path)
    check_ranks(results, ids, expected, hf_experts, ep)
    for r in results:
        assert r["same"] and r["read"] == r["should_read"] < 0.6 * total
        torch.testing.assert_close(r["sliced_logits"], r["logits"], rtol=0, atol=0)


def test_transformers_float32_routing_is_within_its_rounding_bound(mixtral):
    """Unpatched transformers routes in float32: its combine weights are within the module
    doc's bound of tpedu's float64 ones on the very same router inputs, with the same experts
    (no two probabilities near a tie), and the logits of all three float32 islands within 1e-6."""
    model, ids, expected, _ = mixtral
    config = hf.config_from_hf(model.config)
    dense = DenseGPT(config).double().eval()
    dense.load_state_dict(hf.state_from_hf(model.state_dict(), config))
    inputs = []
    hooks = [
        layer.mlp.gate.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        for layer in model.model.layers
    ]
    out, routes = hf_run(model, ids, exact=False)
    for h in hooks:
        h.remove()
    worst = 0.0
    for block, x, (logits, w32, experts32) in zip(dense.blocks, inputs, routes, strict=True):
        assert w32.dtype == torch.float32  # transformers' float32 island
        with torch.no_grad():
            r = block.mlp.router(x.reshape(-1, config.hidden))
        torch.testing.assert_close(r.logits, logits, **TIGHT)  # the gate itself: float64
        assert torch.equal(r.experts, experts32)
        sorted_probs = r.probs.sort(dim=-1, descending=True).values
        top = r.logits.abs().max().item()
        assert (sorted_probs[:, K - 1] - sorted_probs[:, K]).min() > 2 * (4 * top + 3) * U
        bound = (8 * top + 8) * U
        error = ((w32.double() - r.weights) / r.weights).abs().max().item()
        assert 0 < error <= bound, (error, bound)
        worst = max(worst, error)
    with torch.no_grad():
        ours = dense(ids)
    torch.testing.assert_close(ours, expected, **TIGHT)
    torch.testing.assert_close(ours, out.logits, rtol=0, atol=1e-6)
    assert worst > U / 4  # the island is real: float32 rounding, not float64's


def test_export_round_trips_into_transformers(mixtral):
    """HF -> tpedu -> HF gives back every tensor bit for bit (fused experts included), a config
    transformers builds, and a model with identical logits."""
    model, ids, expected, _ = mixtral
    config = hf.config_from_hf(model.config)
    theirs = hf.state_to_hf(hf.state_from_hf(model.state_dict(), config), config)
    ours = model.state_dict()
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key
    cfg = hf.hf_config(config)
    assert hf.config_from_hf(cfg) == config
    cfg._experts_implementation = "eager"
    exported = transformers.MixtralForCausalLM(cfg).double().eval()
    exported.load_state_dict(theirs)
    assert torch.equal(hf_run(exported, ids)[0].logits, expected)


def test_checkpoint_exports_the_save_pretrained_tensors(mixtral, tmp_path, capfd):
    """`tpedu reshard CKPT --to hf` (export_hf) of a tp-2 checkpoint of the HF weights writes the
    very tensors save_pretrained writes (per expert), and transformers loads the directory."""
    from tpedu import checkpoint

    model, ids, expected, _ = mixtral
    model.save_pretrained(tmp_path / "theirs")
    files = load_file(tmp_path / "theirs" / "model.safetensors")
    config = hf.config_from_hf(model.config)
    state = hf.state_from_hf(files, config)
    ck = checkpoint.write_sharded(tmp_path / "c", config, state, 3, ParallelConfig(2))
    code, _, err = cli(capfd, "reshard", str(ck), "--to", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0, err
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == files.keys()
    for key, value in files.items():
        assert torch.equal(exported[key], value), key
    back = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float64, experts_implementation="eager"
    ).eval()
    assert back.config.model_type == "mixtral"
    assert torch.equal(hf_run(back, ids)[0].logits, expected)


def test_cli_refuses_to_export_what_mixtral_cannot_express(tmp_path, capfd):
    """A checkpoint with a shared expert: `reshard --to hf` fails in one line, nothing written."""
    from tpedu import checkpoint

    config = GPTConfig.llama_like(
        40, seq_len=16, n_layers=1, hidden=32, experts=E, shared_expert=True
    )
    ck = checkpoint.write_sharded(tmp_path / "c", config, DenseGPT(config).state_dict(), 1)
    args = ["reshard", str(ck), "--to", "hf", "--out", str(tmp_path / "hf")]
    one_line_error(capfd, args, "Mixtral needs shared_expert=False")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("tied", "top_k"), [(False, 2), (True, 1)])
def test_tpedu_moe_runs_in_transformers(tied, top_k):
    """A tpedu-initialised Mixtral-shaped model (top-1 too: renormalised, its weight is 1),
    exported, computes tpedu's logits in transformers; a tied head comes back tied."""
    torch.manual_seed(0)
    shape = {"seq_len": 16, "n_layers": 2, "hidden": 32, "ffn_hidden": 48, "rope_theta": 300.0}
    config = GPTConfig.llama_like(40, tie_embeddings=tied, experts=E, top_k=top_k, **shape)
    dense = DenseGPT(config).double().eval()
    scramble(dense)
    ids = torch.randint(0, 40, (2, 10))
    cfg = hf.hf_config(config)
    assert hf.config_from_hf(cfg) == config
    cfg._experts_implementation = "eager"
    exported = transformers.MixtralForCausalLM(cfg).double().eval()
    exported.load_state_dict(hf.state_to_hf(dense.state_dict(), config))
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) == tied
    with torch.no_grad():
        torch.testing.assert_close(hf_run(exported, ids)[0].logits, dense(ids), **TIGHT)


def test_the_auxiliary_losses_differ_as_documented(mixtral):
    """transformers' load-balancing loss is E · Σ_e f̄_e · P̄_e over the layers' averages, f̄
    summing to k; tpedu's is per layer with f summing to 1: for one layer, transformers' = k ·
    tpedu's (transformers computes it in float32: 1e-6)."""
    model, ids, _, _ = mixtral
    config = hf.config_from_hf(model.config)
    dense = DenseGPT(config).double().eval()
    dense.load_state_dict(hf.state_from_hf(model.state_dict(), config))
    with torch.no_grad():
        dense(ids)
    stats = [b.moe_stats for b in dense.blocks]
    out, _ = hf_run(model, ids, output_router_logits=True)
    counts = sum(s.tokens_per_expert for s in stats).double() / (len(stats) * ids.numel())
    probs = sum(s.logits.softmax(-1).mean(0) for s in stats) / len(stats)
    tol = {"rtol": 1e-6, "atol": 0}
    torch.testing.assert_close(out.aux_loss.double(), E * (counts * probs).sum(), **tol)
    for s in stats:
        one = modeling_mixtral.load_balancing_loss_func((s.logits,), E, K)
        torch.testing.assert_close(one.double(), K * s.aux_loss, **tol)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ({"sliding_window": 8}, "sliding_window 8 < max_position_embeddings 16"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_experts_per_tok": 3}, "num_experts_per_tok 3 of 4 experts"),
        ({"head_dim": 16}, "head_dim 16"),
    ],
)
def test_what_tpedu_cannot_express_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        hf.config_from_hf(tiny_mixtral(**overrides))
    assert "\n" not in str(e.value) and "Mixtral config" in str(e.value)


def test_a_window_covering_every_position_is_full_attention():
    assert hf.config_from_hf(tiny_mixtral(sliding_window=16)).experts == E


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shared_expert": True}, "Mixtral needs shared_expert=False"),
        ({"capacity_factor": 1.25}, "Mixtral needs capacity_factor=None"),
        ({"router_renormalize": False}, "Mixtral needs router_renormalize=True"),
        ({"moe_every": 2}, "Mixtral needs moe_every=1"),
        ({"norm": "layernorm"}, "Mixtral needs norm='rmsnorm'"),
    ],
)
def test_what_mixtral_cannot_express_is_not_exported(overrides, message):
    config = GPTConfig.llama_like(40, n_layers=2, hidden=32, experts=E, **overrides)
    for export in (hf.hf_config, lambda c: hf.state_to_hf({}, c)):
        with pytest.raises(ValueError, match=message) as e:
            export(config)
        assert "\n" not in str(e.value)


def test_a_dense_model_is_not_mixtral():
    with pytest.raises(ValueError, match="export it as Llama"):
        hf_mixtral.hf_config(GPTConfig.llama_like(40))
    assert hf.family(GPTConfig.llama_like(40)).__name__.endswith("hf_llama")
    assert hf.family(GPTConfig.gpt2_like(40, experts=E)) is hf_mixtral  # refuses it, in one line

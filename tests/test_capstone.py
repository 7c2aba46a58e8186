"""The capstone's tools and grader (tpedu.course.capstone): the budget admits several layouts
that trade memory against bytes sent; a real run's artefacts pass every check; each kind of
damage is caught by its own check, with a one-line reason, without raising; and the served
ids are generated again from the checkpoint, so a generated.json written by hand fails.

One run (4 ranks, tp=2 × pp=2, 4 steps) makes the artefacts; each test damages a copy."""

import json
import shutil

import pytest
import torch

from tests.helpers import make_artefacts
from tpedu import checkpoint
from tpedu.course import capstone
from tpedu.course.capstone import BUDGET, MB, describe, measure
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig
from tpedu.train.loop import count_parameters

CHOICE = ParallelConfig(tp=2, pp=2)  # the reference's choice: the most memory headroom
NAMES = [name for name, _ in capstone.CHECKS]
VOCAB = 4334  # the novel's characters (novel_data("char"))


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    return make_artefacts(tmp_path_factory.mktemp("capstone"), CHOICE)


@pytest.fixture
def work(artefacts, tmp_path):
    return shutil.copytree(artefacts, tmp_path / "work")


def verdicts(work):
    checks = capstone.check_capstone(work)
    assert [c.name for c in checks] == NAMES
    for c in checks:
        assert "\n" not in str(c) and str(c).startswith("✓" if c.ok else "✗"), str(c)
    return {c.name: c.ok for c in checks}


def failed(work):
    return [name for name, ok in verdicts(work).items() if not ok]


def edit(work, name, change):
    data = json.loads((work / name).read_text())
    change(data)
    (work / name).write_text(json.dumps(data, ensure_ascii=False))


# ------------------------------------------------------------------------------ the budget


def test_the_budget_admits_several_layouts_that_trade():
    """Three layouts within both bounds, none best on both memory and bytes sent; plain data
    parallelism holds too much, tp=2 × pp=2 with sequence parallelism sends too much."""
    config = BUDGET.model(VOCAB)
    fitting = [
        measure(config, p) for p in (CHOICE, ParallelConfig(pp=2, dp=2), ParallelConfig(pp=4))
    ]
    assert all(c.fits() for c in fitting), "\n".join(map(str, fitting))
    least_memory = min(fitting, key=lambda c: c.peak)
    least_sent = min(fitting, key=lambda c: c.sent)
    assert least_memory is not least_sent  # a trade, not a single answer
    assert least_memory.parallel == CHOICE
    over_memory = measure(config, ParallelConfig(dp=4))
    assert over_memory.peak > BUDGET.bytes_per_rank and over_memory.sent <= BUDGET.sent_per_rank
    over_sent = measure(config, ParallelConfig(tp=2, pp=2, sequence_parallel=True))
    assert over_sent.peak <= BUDGET.bytes_per_rank and over_sent.sent > BUDGET.sent_per_rank
    assert capstone.fits(config, CHOICE) and not capstone.fits(config, ParallelConfig(dp=4))
    with pytest.raises(ValueError, match="uses 2 ranks; the budget has 4"):
        measure(config, ParallelConfig(tp=2))


def test_bytes_sent_leave_out_groups_of_one_rank():
    """dp=4 moves its gradients (4 bytes each) and the loss's few bytes over the world; the
    tracer also records the TP and PP calls of its groups of one rank, which move nothing."""
    config = BUDGET.model(VOCAB)
    params = count_parameters(config)
    sent = measure(config, ParallelConfig(dp=4)).sent
    assert 4 * params <= sent <= 4 * params + 64


def test_a_step_is_timed_on_real_ranks():
    config = GPTConfig.gpt2_like(61, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    ids = torch.arange(400) % 61
    budget = capstone.Budget(ranks=2, batch=4)
    seconds = capstone.step_seconds(config, ParallelConfig(pp=2), ids, budget, steps=2)
    assert 0 < seconds < 30


@pytest.mark.parametrize(
    "why",
    [
        "tp=2 pp=2 dp=1: 18.4 MB of 25 MB",
        "TP 2 × PP 2 leaves 26% headroom",
        "tp2 pp2, 324 ms per step against 210 ms for pp=2 dp=2",
    ],
)
def test_a_reason_that_names_the_layout_and_a_figure_holds(why):
    assert capstone.check_why(why, CHOICE).startswith("names tp=2 pp=2 dp=1 and cites")


@pytest.mark.parametrize(
    ("why", "parallel", "missing"),
    [
        ("", CHOICE, "no reason"),
        ("pp=4: 20.8 MB, the least traffic", CHOICE, "no tp=2, pp=2"),
        ("tp=2 pp=2 because it is what the lesson did", CHOICE, "cites no figure"),
        ("pp=2 dp=2: 22.2 MB", ParallelConfig(pp=2, dp=2, zero=2), "no zero=2"),
        ("pp=2 dp=2 ZeRO-2: 22.2 MB", ParallelConfig(pp=2, dp=2, zero=2), None),
        ("tp=2 pp=2: 16.5 MB", ParallelConfig(tp=2, pp=2, sequence_parallel=True), "sequence"),
    ],
)
def test_a_reason_without_the_layout_or_a_figure_is_refused(why, parallel, missing):
    if missing is None:
        capstone.check_why(why, parallel)
        return
    with pytest.raises(ValueError, match=missing):
        capstone.check_why(why, parallel)


# ------------------------------------------------------------------------------ the grader


def test_a_real_run_passes_every_check(artefacts):
    checks = capstone.check_capstone(artefacts)
    assert capstone.passed(checks), "\n".join(map(str, checks))


def test_a_layout_over_the_budget_is_caught(work):
    capstone.write_choice(work, ParallelConfig(dp=4), "tp=1 pp=1 dp=4: 5.46 MB sent")
    assert "the layout fits the budget" in failed(work)
    # the checkpoint, the training run and the serving no longer match the choice either
    assert {"the checkpoint validates", "the resumed run continues the loss"} <= set(failed(work))


@pytest.mark.parametrize("why", ["", "pp=4 dp=1: 4.32 MB sent", "tp=2 pp=2: it felt right"])
def test_a_missing_or_wrong_reason_is_caught(work, why):
    capstone.write_choice(work, CHOICE, why)
    assert failed(work) == ["the choice says why"]


def test_a_corrupted_shard_is_caught(work):
    shard = next((work / "ckpt" / "step_00000004").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    assert failed(work) == ["the checkpoint validates"]


def test_a_reshard_that_changes_a_tensor_is_caught(work):
    config, tensors, index = checkpoint.read_dense(work / "resharded")
    tensors["norm_f.weight"] = tensors["norm_f.weight"] + 1e-6
    shutil.rmtree(work / "resharded")
    checkpoint.write_sharded(work / "resharded", config, tensors, index["step"], header=index)
    assert failed(work) == ["the reshard keeps every tensor"]


def test_a_resumed_loss_off_by_1e_4_is_caught(work):
    edit(work, "resumed.json", lambda r: r["losses"].__setitem__(0, r["losses"][0] * (1 + 1e-4)))
    assert failed(work) == ["the resumed run continues the loss"]


def _hand_written(gen):
    """Ids that agree at every tp and have the right length, but are not the model's."""
    for ids in gen["ids"].values():
        ids[-1] = (ids[-1] + 1) % VOCAB


def _other_text(gen):
    gen["text"] = "却说宝玉" * 2


def _too_short(gen):
    gen["ids"] = {tp: ids[:-1] for tp, ids in gen["ids"].items()}


def _other_settings(gen):
    gen["sampling"] = {"greedy": True}


def _one_tp_only(gen):
    del gen["ids"]["2"]


@pytest.mark.parametrize(
    "damage", [_hand_written, _other_text, _too_short, _other_settings, _one_tp_only]
)
def test_served_ids_that_resumed_does_not_generate_are_caught(work, damage):
    edit(work, "generated.json", damage)
    assert failed(work) == ["the served text is the checkpoint's"]


def test_a_hand_written_generated_json_says_where_it_differs(work):
    edit(work, "generated.json", _hand_written)
    check = next(c for c in capstone.check_capstone(work) if not c.ok)
    new = json.loads((work / "generated.json").read_text())["max_new_tokens"]
    assert f"not what resumed/ generates: they differ from new token {new - 1} on" in check.detail


def test_an_empty_directory_fails_every_check_without_raising(tmp_path):
    checks = capstone.check_capstone(tmp_path)
    assert not any(c.ok for c in checks) and not capstone.passed(checks)
    assert all(c.detail for c in checks)


def test_the_budget_and_the_figures_print_in_megabytes():
    c = capstone.Candidate(CHOICE, 18_430_000, 12_670_000)
    assert str(c) == f"{describe(CHOICE):<46}  18.43 MB held  12.67 MB sent"
    assert c.fits() and not c.fits(capstone.Budget(bytes_per_rank=18 * MB))

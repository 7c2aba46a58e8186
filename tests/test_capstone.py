"""The capstone's tools and grader (tpedu.course.capstone): the budget admits several layouts
that trade memory against bytes sent; a real run's artefacts pass every check; each kind of
damage is caught by its own check, with a one-line reason, without raising; and the served
ids are generated again from the checkpoint, so a generated.json written by hand fails.

One run (4 ranks, tp=2 × pp=2, 4 steps) makes the artefacts; each test damages a copy."""

import importlib.util
import json
import math
import shutil
from dataclasses import asdict

import pytest
import torch

from tests.helpers import capstone_space, make_artefacts
from tpedu import checkpoint
from tpedu.course import capstone
from tpedu.course.capstone import BUDGET, MB, describe, measure
from tpedu.course.grading import implementation
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


@pytest.fixture(scope="module")
def surveyed():
    config = BUDGET.model(VOCAB)
    return {describe(p): measure(config, p) for p in capstone_space(4)}


FITS = [  # the layouts within the budget, each with something the others lack
    ParallelConfig(tp=2, pp=2),  # the least memory
    ParallelConfig(pp=4),  # the fewest bytes on the wire
    ParallelConfig(pp=2, dp=2, zero=2),
    ParallelConfig(pp=2, dp=2, zero=3),
]


def test_the_budget_admits_several_layouts_that_trade(surveyed):
    """Four layouts within both bounds, none best on both memory and bytes on the wire; plain
    data parallelism and the two-stage pipeline with two replicas hold too much (ZeRO-1 saves
    nothing at that peak), tp=2 × pp=2 with sequence parallelism puts too much on the wire."""
    fitting = [describe(c.parallel) for c in surveyed.values() if c.fits()]
    assert sorted(fitting) == sorted(describe(p) for p in FITS), fitting
    fit = [surveyed[describe(p)] for p in FITS]
    assert min(fit, key=lambda c: c.peak).parallel == CHOICE
    assert min(fit, key=lambda c: c.sent).parallel == ParallelConfig(pp=4)
    over_memory = [
        surveyed[describe(p)] for p in (ParallelConfig(dp=4), ParallelConfig(pp=2, dp=2))
    ]
    assert all(
        c.peak > BUDGET.bytes_per_rank >= 0 and c.sent <= BUDGET.sent_per_rank for c in over_memory
    )
    zero1 = surveyed[describe(ParallelConfig(pp=2, dp=2, zero=1))]
    # the same peak, and the same bytes on the wire (the gradient norm goes over the world)
    assert zero1.peak == over_memory[1].peak and zero1.sent == over_memory[1].sent
    sp = surveyed[describe(ParallelConfig(tp=2, pp=2, sequence_parallel=True))]
    assert sp.peak < surveyed[describe(CHOICE)].peak and sp.sent > BUDGET.sent_per_rank
    assert capstone.fits(BUDGET.model(VOCAB), CHOICE)
    assert not capstone.fits(BUDGET.model(VOCAB), ParallelConfig(dp=4))
    with pytest.raises(ValueError, match="uses 2 ranks; the budget has 4"):
        measure(BUDGET.model(VOCAB), ParallelConfig(tp=2))


def test_bytes_on_the_wire_are_the_ring_volumes(surveyed):
    """dp=4 all-reduces every gradient (4 bytes each) over 4 ranks: 2·3/4 of them on the wire,
    and 20 bytes over the world (the gradient norm's float64, the loss's, the stop check's 4);
    its groups of one rank move nothing. ZeRO-1 and ZeRO-2 reduce-scatter and all-gather
    instead, 3/4 each: the same bytes, not twice as many. Sequence parallelism's all-gathers
    and reduce-scatters carry half an all-reduce's bytes each: more bytes than TP only because
    backward gathers its input again."""
    params = count_parameters(BUDGET.model(VOCAB))
    dp4 = surveyed[describe(ParallelConfig(dp=4))].sent
    assert dp4 == 2 * 3 * 4 * params // 4 + 2 * 3 * 20 // 4
    for zero in (1, 2):
        assert surveyed[describe(ParallelConfig(dp=4, zero=zero))].sent == dp4
    tp, sp = (
        surveyed[describe(ParallelConfig(tp=2, pp=2, sequence_parallel=s))].sent
        for s in (False, True)
    )
    assert tp < sp < 1.25 * tp


def test_a_step_is_timed_on_real_ranks():
    config = GPTConfig.gpt2_like(61, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    ids = torch.arange(400) % 61
    budget = capstone.Budget(ranks=2, batch=4)
    seconds = capstone.step_seconds(config, ParallelConfig(pp=2), ids, budget, steps=2)
    assert 0 < seconds < 30


def mb(x):
    return f"{x / MB:.2f} MB"


@pytest.fixture(scope="module")
def mine(surveyed):
    return surveyed[describe(CHOICE)]


@pytest.mark.parametrize(
    "why",
    [
        "tp=2 pp=2 dp=1: {held} of 23 MB",
        "TP 2 × PP 2 puts {wire} on the wire, within 13 MB",
        "tp2 pp2: {held_rounded}, 324 ms per step against 210 ms for pp=4 (20.75 MB)",
        "tp=2 pp=2 dp=1: {held}, {wire}; pp=4 sends 3.27 MB and pp=2 dp=2 zero=3 holds 20.3 MB",
    ],
)
def test_a_reason_that_names_the_layout_and_its_figures_holds(why, mine):
    why = why.format(
        held=mb(mine.peak), wire=mb(mine.sent), held_rounded=f"{mine.peak / MB:.0f} MB"
    )
    assert capstone.check_why(why, mine).startswith("names tp=2 pp=2 dp=1 and cites its dry run's")


@pytest.mark.parametrize(
    ("why", "refused"),
    [
        ("", "no reason"),
        ("pp=4: 20.75 MB, the least traffic", "no tp=2, pp=2"),
        ("tp=2 pp=2 because it is what the lesson did", r"no figure .* \(none\) is within 5%"),
        ("tp=2 pp=2 leaves 20% headroom", r"\(none\)"),
        ("tp=1 pp=4 dp=1: {held}, then tp=2 pp=2", "names 'tp=1' before it names tp=2 pp=2 dp=1"),
        ("pp=4 holds 20.75 MB, so tp=2 pp=2: {held}", "names 'pp=4' before"),
        ("tp=2 pp=2 dp=1: 20.75 MB held, 3.27 MB on the wire", "is within 5% of the dry run's"),
        ("tp=2 pp=2 dp=1, 1 MB", r"\(1 MB\) is within 5%"),
        ("tp=2 pp=2: " + ", ".join(f"{k} MB" for k in range(1, 31)), "not a list"),
    ],
)
def test_a_reason_without_the_layout_or_its_figures_is_refused(why, refused, mine):
    with pytest.raises(ValueError, match=refused):
        capstone.check_why(why.format(held=mb(mine.peak)), mine)


@pytest.mark.parametrize(
    ("parallel", "why", "refused"),
    [
        (ParallelConfig(pp=2, dp=2, zero=2), "pp=2 dp=2: {held}", "no zero=2"),
        (ParallelConfig(pp=2, dp=2, zero=2), "pp=2 dp=2 ZeRO-2: {held}", None),
        (ParallelConfig(pp=2, dp=2, zero=2), "pp=2 dp=2 ZeRO-3 zero=2: {held}", "'ZeRO-3' before"),
        (ParallelConfig(tp=2, pp=2, sequence_parallel=True), "tp=2 pp=2: {held}", "sequence"),
        (ParallelConfig(tp=2, pp=2, sequence_parallel=True), "tp=2 pp=2 SP: {wire}", None),
    ],
)
def test_the_zero_stage_and_sequence_parallelism_are_part_of_the_name(
    parallel, why, refused, surveyed
):
    c = surveyed[describe(parallel)]
    why = why.format(held=mb(c.peak), wire=mb(c.sent))
    if refused is None:
        capstone.check_why(why, c)
        return
    with pytest.raises(ValueError, match=refused):
        capstone.check_why(why, c)


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
    # and the grader's resume from it is not the run resumed/ holds
    assert failed(work) == ["the reshard keeps every tensor", "the resumed run continues the loss"]


def refused(work):
    """{name: detail} of the checks that fail, from one grading."""
    checks = capstone.check_capstone(work)
    return {c.name: c.detail for c in checks if not c.ok}


RESUME = "the resumed run continues the loss"


def test_a_straight_loss_off_by_1e_4_is_caught(work):
    """The grader resumes resharded/ itself: its losses must continue train.json's."""
    edit(work, "train.json", lambda r: r["losses"].__setitem__(-1, r["losses"][-1] * (1 + 1e-4)))
    why = refused(work)
    assert list(why) == [RESUME]
    assert "run again here: loss" in why[RESUME] and "> 1e-05" in why[RESUME]


def test_a_resumed_json_that_is_not_the_run_is_caught(work):
    """resumed.json must be what resuming gives, bit for bit: one ulp off is another run."""
    nudge = lambda r: r["losses"].__setitem__(0, math.nextafter(r["losses"][0], 0))
    edit(work, "resumed.json", nudge)
    why = refused(work)
    assert list(why) == [RESUME]
    assert "resumed.json's losses are not what resuming resharded/" in why[RESUME]


def _never_resumed(work):
    """The resume skipped: resumed.json is train.json with the resharded layout and the
    straight run's losses from the resharded step on; resumed/ is the straight run's last
    checkpoint resharded to that layout (what a served model needs, at the right step). On
    this fresh model the two layouts' sums in other orders leave the straight run's last bits
    unlike the resume's, so the copy is not what resuming gives. (Where two layouts agree bit
    for bit, a copy is what resuming gives, and the grader has run the resume itself.)"""
    start = checkpoint.read_index(work / "resharded")[1]["step"]
    straight = json.loads((work / "train.json").read_text())
    first = straight["settings"]["train"]["steps"] - len(straight["losses"])
    there = checkpoint.read_parallel(work / "resharded")
    fake = {**straight, "losses": straight["losses"][start - first :]}
    fake["settings"] = {**straight["settings"], "parallel": there.to_dict()}
    (work / "resumed.json").write_text(json.dumps(fake))
    shutil.rmtree(work / "resumed")
    checkpoint.reshard(checkpoint.resolve(work / "ckpt"), work / "resumed", tp=1)


def test_losses_copied_into_resumed_json_without_resuming_are_caught(work):
    _never_resumed(work)
    why = refused(work)  # (the served text may differ too: another model)
    assert "resumed/ is not the state resuming resharded/ reaches" in why[RESUME]


def test_the_straight_runs_checkpoint_as_resumed_is_caught(work):
    shutil.rmtree(work / "resumed")
    shutil.copytree(work / "ckpt", work / "resumed")
    assert "resumed/ holds tp=2 pp=2 dp=1, resumed.json ran tp=1" in refused(work)[RESUME]


def test_a_resume_from_another_step_is_caught(work):
    """resumed.json's layout and losses are not enough: the run is checked from resharded/."""
    edit(work, "resumed.json", lambda r: r["losses"].append(r["losses"][-1]))
    why = refused(work)
    assert list(why) == [RESUME]
    assert "resumed.json has 2 losses, the resume 1" in why[RESUME]


@pytest.mark.parametrize(
    ("why", "says"),
    [
        ("tp=1 pp=4 dp=1: 20.75 MB held, 3.27 MB on the wire", "no tp=2, pp=2"),
        ("pp=4 dp=1: 20.75 MB, then tp=2 pp=2 dp=1", "names 'pp=4' before"),
        ("tp=2 pp=2 dp=1, 1 MB", "no figure the reason cites for tp=2 pp=2 dp=1 (1 MB)"),
        ("tp=2 pp=2 dp=1: 20.75 MB held, 3.27 MB on the wire", "within 5% of the dry run's"),
    ],
)
def test_a_reason_with_another_layout_or_wrong_figures_is_caught(work, why, says):
    capstone.write_choice(work, CHOICE, why)
    why = refused(work)
    assert list(why) == ["the choice says why"]
    assert says in why["the choice says why"]


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


def test_sampling_with_an_unknown_key_is_refused_before_serving(tmp_path):
    """generated.json's sampling is read back as a Sampling: a key Sampling lacks fails the
    check with one line naming it and the fix, before any rank is launched (there is no
    checkpoint to serve here)."""
    capstone.write_choice(tmp_path, CHOICE, "tp=2 pp=2 dp=1")
    sampling = {**asdict(capstone.SAMPLING), "topk": 10}
    gen = {"prompt": [1, 2], "max_new_tokens": 1, "sampling": sampling}
    gen |= {"ids": {"1": [1, 2, 3], "2": [1, 2, 3]}, "text": "x"}
    (tmp_path / "generated.json").write_text(json.dumps(gen))
    check = by_name(capstone.check_capstone(tmp_path))["the served text is the checkpoint's"]
    assert not check.ok and "\n" not in str(check)
    assert "sampling has an unknown key 'topk'" in check.detail
    assert "dataclasses.asdict(Sampling(...))" in check.detail


# ------------------------------------------------------------------------------ whose choice

OWN = """
from tpedu.course.capstone import describe, measure
from tpedu.parallel.config import ParallelConfig


def survey(config, budget):
    pairs = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)]
    return [measure(config, ParallelConfig(tp=t, pp=p, dp=4 // (t * p)), budget) for t, p in pairs]


def choose(found, seconds, budget):
    c = min((c for c in found if c.fits(budget)), key=lambda c: c.peak)
    return c.parallel, f"{describe(c.parallel)}: {c.peak / 1e6:.2f} MB held"
"""
BORROWED = "from solutions.l20_capstone import survey, choose\n"
AT_RUN_TIME = OWN.replace(
    "def survey(config, budget):",
    "def survey(config, budget):\n"
    "    import importlib\n\n"
    "    return importlib.import_module('sol' + 'utions.l20_capstone').survey(config, budget)\n\n\n"
    "def _unused(config, budget):",
)
AUTHOR = capstone.AUTHOR_CHECK


def learner(tmp_path, source):
    """A learner's exercise module, loaded from its own file."""
    path = tmp_path / "l18_learner.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"learner_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def choose_with(work, module):
    found = module.survey(BUDGET.model(VOCAB), BUDGET)
    choice, why = module.choose(found, {}, BUDGET)
    capstone.write_choice(work, choice, why, seconds={})
    return choice


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_choice_your_own_code_made_passes(work, tmp_path):
    mine = learner(tmp_path, OWN)
    assert choose_with(work, mine) == CHOICE
    checks = capstone.check_capstone(work, exercise=mine)
    assert capstone.passed(checks), "\n".join(map(str, checks))
    assert [c.name for c in checks] == [*NAMES, AUTHOR]


def test_a_choice_from_solutions_is_not_yours(work, tmp_path):
    """Imported from solutions/, or the reference module itself (what `pick` returns under
    TPEDU_IMPL=solutions): the reference's, whatever choice.json says."""
    choose_with(work, learner(tmp_path, OWN))
    for module in (learner(tmp_path, BORROWED), implementation("l20_capstone", "solutions")):
        check = by_name(capstone.check_capstone(work, exercise=module))[AUTHOR]
        assert not check.ok and "survey and choose are the reference's (solutions/)" in check.detail


def test_a_choice_that_reaches_solutions_at_run_time_is_not_yours(work, tmp_path):
    choose_with(work, learner(tmp_path, OWN))
    check = by_name(capstone.check_capstone(work, exercise=learner(tmp_path, AT_RUN_TIME)))[AUTHOR]
    assert not check.ok and "your survey or choose reaches solutions/" in check.detail
    assert callable(importlib.import_module("solutions.l20_capstone").choose)  # importable again


def test_a_choice_json_your_choose_did_not_write_is_caught(work, tmp_path):
    mine = learner(tmp_path, OWN)
    choose_with(work, mine)
    edit(work, "choice.json", lambda c: c.__setitem__("why", c["why"] + " (and pp=4)"))
    check = by_name(capstone.check_capstone(work, exercise=mine))[AUTHOR]
    assert not check.ok and "choice.json is not what your choose returns" in check.detail


def test_an_empty_directory_fails_every_check_without_raising(tmp_path):
    checks = capstone.check_capstone(tmp_path)
    assert not any(c.ok for c in checks) and not capstone.passed(checks)
    assert all(c.detail for c in checks)


def test_the_budget_and_the_figures_print_in_megabytes():
    c = capstone.Candidate(CHOICE, 18_430_000, 11_620_000)
    assert str(c) == f"{describe(CHOICE):<46}  18.43 MB held  11.62 MB on the wire"
    assert c.fits() and not c.fits(capstone.Budget(bytes_per_rank=18 * MB))

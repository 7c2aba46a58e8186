"""The capstone's grader (tpedu.course.capstone): a real run's artefacts pass every check, and
each kind of damage is caught by its own check, with a one-line reason, without raising.

One run (4 ranks, tp=2 × pp=2, 4 steps) makes the artefacts; each test damages a copy."""

import json
import shutil

import pytest

from tests.helpers import make_artefacts
from tpedu import checkpoint
from tpedu.course import capstone
from tpedu.parallel.config import ParallelConfig

CHOICE = ParallelConfig(tp=2, pp=2)  # the budget's first fit (tests/exercises/test_l18_capstone)
NAMES = [name for name, _ in capstone.CHECKS]


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


def test_a_real_run_passes_every_check(artefacts):
    checks = capstone.check_capstone(artefacts)
    assert capstone.passed(checks), "\n".join(map(str, checks))


def test_a_layout_over_the_budget_is_caught(work):
    (work / "choice.json").write_text(json.dumps(ParallelConfig(dp=4).to_dict()))
    assert "the layout fits the budget" in failed(work)
    # the checkpoint, the training run and the serving no longer match the choice either
    assert {"the checkpoint validates", "the resumed run continues the loss"} <= set(failed(work))


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
    resumed = json.loads((work / "resumed.json").read_text())
    resumed["losses"][0] *= 1 + 1e-4
    (work / "resumed.json").write_text(json.dumps(resumed))
    assert failed(work) == ["the resumed run continues the loss"]


@pytest.mark.parametrize("damage", ["other ids", "too short"])
def test_served_ids_that_differ_or_fall_short_are_caught(work, damage):
    gen = json.loads((work / "generated.json").read_text())
    if damage == "other ids":
        gen["ids"]["2"][-1] += 1
    else:
        gen["ids"] = {tp: ids[:-1] for tp, ids in gen["ids"].items()}
    (work / "generated.json").write_text(json.dumps(gen))
    assert failed(work) == ["the served text"]


def test_an_empty_directory_fails_every_check_without_raising(tmp_path):
    checks = capstone.check_capstone(tmp_path)
    assert not any(c.ok for c in checks) and not capstone.passed(checks)
    assert all(c.detail for c in checks)


def test_the_budget_is_tight():
    """The reference choice fits; plain data parallelism (everything replicated) does not."""
    config = capstone.BUDGET.model(4334)
    assert capstone.fits(config, CHOICE)[0]
    ok, peak = capstone.fits(config, ParallelConfig(dp=4))
    assert not ok and peak > 2 * capstone.BUDGET.bytes_per_rank
    with pytest.raises(ValueError, match="uses 2 ranks; the budget has 4"):
        capstone.fits(config, ParallelConfig(tp=2))

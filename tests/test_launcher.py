"""The launcher's promises, one test each: results in rank order, the original error with its
rank and traceback, hangs and killed ranks detected, Ctrl-C, no process left behind, and
back-to-back / repeated launches."""

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tpedu
from tests.processes import (
    STARTUP_S,
    signal_sleeping_ranks,
    sleeping_ranks_script,
    wait_for_ranks,
)
from tpedu import LaunchTimeout, RankError, launch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def rank_info(scale):
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return {"rank": dist.get_rank(), "sum": x * scale, "threads": torch.get_num_threads()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    out = launch(rank_info, world_size, 2.0)
    assert [o["rank"] for o in out] == list(range(world_size))
    total = world_size * (world_size + 1) / 2
    assert all(torch.equal(o["sum"], torch.tensor([2.0 * total])) for o in out)
    assert all(o["threads"] == 1 for o in out), "each rank must run on one thread"


def raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(0.2)  # the others are already blocked in the barrier
        raise ValueError(f"bad value on rank {bad_rank}")
    dist.barrier()


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_the_original_exception_is_reported_with_rank_and_traceback(bad_rank):
    with pytest.raises(RankError) as info:
        launch(raise_on_rank, 2, bad_rank, timeout=30)
    err = info.value
    assert err.rank == bad_rank
    assert str(err).startswith(f"rank {bad_rank} of 2 raised ValueError: bad value on rank")
    assert "raise_on_rank" in err.remote_traceback  # the worker's own frame, not the launcher's


def hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.barrier()


def test_a_hang_becomes_a_timeout_error():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"ranks \[.*1.*\] of 2 did not finish within 2 s"):
        launch(hang_on_rank_1, 2, timeout=2)
    assert time.monotonic() - start < 15


def die_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_killed_rank_is_detected():
    with pytest.raises(RankError, match="rank 1 of 2 was killed by signal SIGKILL") as info:
        launch(die_on_rank_1, 2, timeout=30)
    assert info.value.rank == 1


def print_out_of_order():
    rank = dist.get_rank()
    time.sleep(0.3 * (dist.get_world_size() - rank))  # the last rank prints first
    print(f"hello from {rank}")
    print("second line")


def test_output_is_grouped_by_rank_in_rank_order(capsys):
    launch(print_out_of_order, 3)
    assert capsys.readouterr().out.splitlines() == [
        line for r in range(3) for line in (f"[rank {r}] hello from {r}", f"[rank {r}] second line")
    ]


def return_unpicklable():
    return lambda: None


def test_an_unpicklable_result_is_a_clear_error():
    with pytest.raises(RankError, match="cannot be sent back"):
        launch(return_unpicklable, 2)


def test_refuses_when_cuda_is_initialised_in_the_parent(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised"):
        launch(rank_info, 2, 1.0)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        launch(rank_info, 0, 1.0)


@pytest.mark.parametrize("attempt", range(20))
def test_repeated_launches_pass_every_time(attempt):
    """A multi-rank check run 20 times in a row (fresh port each time) passes 20 times."""
    a, b = launch(rank_info, 2, float(attempt))
    assert a["sum"].item() == b["sum"].item() == 3.0 * attempt


def test_back_to_back_launches_with_failures_in_between():
    for _ in range(3):
        with pytest.raises(RankError):
            launch(raise_on_rank, 2, 1, timeout=30)
        assert [o["rank"] for o in launch(rank_info, 2, 1.0)] == [0, 1]


def test_ctrl_c_kills_every_rank(tmp_path):
    """SIGINT to the launching process (a kernel interrupt) leaves no rank running."""
    out, pids = signal_sleeping_ranks(tmp_path, signal.SIGINT, "KeyboardInterrupt", '"interrupted"')
    assert "interrupted" in out
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"rank process {pid} survived Ctrl-C"


def test_a_kernel_interrupt_kills_every_rank(tmp_path):
    """A notebook's interrupt (SIGINT to the kernel's process group) stops every rank, even
    where the kernel began with SIGINT ignored, as under a Jupyter server started by `nohup` or
    as a background job: the kernel installs Python's handler while a cell runs."""
    from jupyter_client.manager import start_new_kernel

    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel inherits SIGINT ignored
    try:
        km, kc = start_new_kernel(kernel_name="python3", startup_timeout=STARTUP_S)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        cell = sleeping_ranks_script(tmp_path) + "tpedu.launch(work, 2, timeout=600)"
        msg_id = kc.execute(cell)
        pids = wait_for_ranks(tmp_path)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=STARTUP_S)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=STARTUP_S)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists(), f"rank process {pid} survived the interrupt"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_device_is_cpu_on_gloo():
    assert launch(tpedu.device, 2) == [torch.device("cpu")] * 2


def test_backend_override(monkeypatch):
    from tpedu.launcher import default_backend

    monkeypatch.setenv("TPEDU_BACKEND", "nccl")
    assert default_backend(8) == "nccl"
    monkeypatch.setenv("TPEDU_BACKEND", "mpi")
    with pytest.raises(ValueError, match="TPEDU_BACKEND='mpi': use one of gloo, nccl"):
        default_backend(2)
    monkeypatch.setenv("TPEDU_BACKEND", "gloo")
    assert launch(lambda: dist.get_backend(), 2) == ["gloo", "gloo"]


@dataclass
class Held:
    loss: torch.Tensor
    parts: tuple


def nested_tensors():
    w = torch.nn.Parameter(torch.ones(3))
    return Held(loss=(w * 2).sum(), parts=(w, {"g": w * 3}))


def test_tensors_come_back_detached_wherever_they_sit():
    """A dataclass holding a non-leaf tensor that requires grad and a Parameter: both arrive as
    plain detached CPU tensors (the same path moves CUDA tensors to the CPU, so unpickling a
    result never initialises CUDA in the launching process)."""
    (held,) = launch(nested_tensors, 1)
    w, g = held.parts[0], held.parts[1]["g"]
    assert held.loss.item() == 6.0 and not held.loss.requires_grad
    assert type(w) is torch.Tensor and not w.requires_grad and torch.equal(g, torch.full((3,), 3.0))


def test_a_process_group_that_fails_to_form_on_the_first_port_is_retried(monkeypatch, tmp_path):
    """Another process can take (or connect to) the probed port before the ranks bind it; gloo
    then fails inside init_process_group ("Connection closed by peer"). No rank ran the
    function, so the launcher retries on a new port: the caller sees only the result."""
    real = dist.init_process_group
    first = tmp_path / "first-port"

    def flaky(*args, **kwargs):
        port = os.environ["MASTER_PORT"]
        try:
            fd = os.open(first, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, port.encode())
            os.close(fd)
        except FileExistsError:
            time.sleep(0.05)  # the writer finishes its write
        if first.read_text() == port:
            raise RuntimeError("[gloo] connectFullMesh failed: Connection closed by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", flaky)
    assert [r["rank"] for r in launch(rank_info, 2, 1.0)] == [0, 1]


def test_a_process_group_that_never_forms_is_the_ranks_own_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such backend here")

    monkeypatch.setattr(dist, "init_process_group", broken)
    with pytest.raises(RankError, match="no such backend here"):
        launch(rank_info, 2, 1.0)


def build_after_rank_0_returned(what):
    """Rank 0 returns at once; the others, a moment later, create a group of their own."""
    from tpedu.model.config import GPTConfig
    from tpedu.model.gpt import expert_parallel_moe
    from tpedu.model.options import RunOptions
    from tpedu.model.plan import _KINDS, param_kinds
    from tpedu.moe.dense import DenseMoE
    from tpedu.parallel.mesh import Layout, Mesh

    mesh = Mesh(Layout(dp=dist.get_world_size()))  # collective: every rank, before rank 0 goes
    if dist.get_rank() == 0:
        return "returned"
    time.sleep(1.0)
    if what == "plan":
        _KINDS.clear()  # built anew here, not found in a cache from before the fork
        config = GPTConfig(vocab_size=64, seq_len=8, hidden=16, n_heads=2, n_layers=1)
        return sorted(set(param_kinds(config).values()))
    if what == "moe":
        moe = expert_parallel_moe(DenseMoE(8, 16, experts=2), None, RunOptions())
        return dist.get_world_size(moe.group)
    return dist.get_world_size(mesh.ep_group)


@pytest.mark.parametrize("what", ["plan", "moe", "mesh"])
def test_a_rank_that_returns_first_does_not_break_the_others_groups(what):
    """A group of one rank still registers through the job's store, which rank 0's process
    hosts: the launcher keeps rank 0 (and so the store) until every rank has returned."""
    out = launch(build_after_rank_0_returned, 4, what, timeout=60)
    assert out[0] == "returned"
    expected = ["column", "qkv", "replicated", "row", "vocab"] if what == "plan" else 1
    assert out[1:] == [expected] * 3


def rank_0_fails_after_the_others_return():
    if dist.get_rank() == 0:
        time.sleep(0.5)
        raise ValueError("rank 0 failed last")
    return "done"


def test_rank_0_failing_after_the_others_returned_is_its_own_error():
    with pytest.raises(RankError) as info:
        launch(rank_0_fails_after_the_others_return, 3, timeout=30)
    assert info.value.rank == 0 and "rank 0 failed last" in str(info.value)


def rank_1_times_out_after_rank_0_returned():
    if dist.get_rank() == 1:
        time.sleep(0.3)
        raise TimeoutError("pipeline stage 1 timed out waiting for an activation")
    return "done"


def test_a_rank_that_fails_after_rank_0_returned_is_reported_at_once():
    """Rank 0 hosts the store until the others finish, but its result is already in: another
    rank's error, even one that reads like a consequence (a timeout), is the job's error,
    raised at once, not a hang."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(rank_1_times_out_after_rank_0_returned, 2, timeout=60)
    assert info.value.rank == 1 and "pipeline stage 1 timed out" in str(info.value)
    assert time.monotonic() - start < 30

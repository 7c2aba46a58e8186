"""Course infrastructure: run one function on N ranks: from a notebook, a test, the CLI, or under
torchrun.

    results = launch(worker, 2, x)      # worker(x) runs on ranks 0 and 1; results[r] is rank r's return

Inside `worker`, `torch.distributed` is already initialised (gloo on CPU, NCCL on GPUs), so
`dist.get_rank()` and every collective just work. The launcher exists because the plain ways of
starting ranks misbehave in a Jupyter kernel; each rule below answers one measured failure:

- ranks are *forked* (≈0.1 s to all joined; spawn takes 3-5 s, torchrun 4-7 s), so a worker may
  be defined in a notebook cell. Fork is only safe while the parent has not touched CUDA: that
  case is refused with a clear error.
- every rank runs on one CPU thread: GNU OpenMP is not fork-safe, and a forked rank that uses
  several threads after the parent ran threaded work can hang forever. One thread each is also
  faster on a small machine (no oversubscription).
- a fresh free port per launch, so cells re-run back to back never collide.
- rank 0 hosts the job's store (the TCPStore every rank meets through, as torch's
  `tcp://` init does), so rank 0's process leaves last (its result is sent back as soon as it
  has one): ranks finish at different times (a pipeline's last stage, an expert rank with
  fewer tokens), and a rank still creating a group, even a group of itself alone, registers
  it through the store. Under torchrun the agent hosts the
  store and outlives every rank already. When rank 0 fails, it does not wait: the store goes
  with it, the other ranks fail at their next collective or group, and the launcher reports
  rank 0's error as the original, theirs as its consequences.
- each rank's stdout is captured to a file and printed grouped by rank, in rank order, so notebook
  outputs are deterministic.
- the process-group timeout is short; a rank that raises, dies or hangs is detected, every rank
  is killed and joined (no zombies, no orphans), and the *original* failure is raised with its
  rank and traceback (the first error to arrive is often another rank's "connection closed").
- Ctrl-C (SIGINT, a kernel's interrupt) to the launching process kills every rank and raises
  KeyboardInterrupt; the ranks ignore SIGINT themselves, so the launcher alone decides. It leaves
  the caller's own SIGINT handling as it is: a script started with SIGINT ignored (by `nohup`,
  or as a background job of a non-interactive shell) is not stopped by Ctrl-C; send it SIGTERM.
  A Jupyter kernel installs Python's handler while a cell runs, so an interrupt stops every
  rank however the server was started.
- SIGTERM to the launching process (a cluster taking the node back) is passed on to every rank,
  not turned into a kill: training saves and stops (lesson 14, tpedu.train.preempt). The wait
  for the ranks is then bounded by the collective timeout. When every rank raises a `Stopped`
  exception (every rank chose to stop together), rank 0's is raised as itself, not a RankError.

Under torchrun (single- or multi-node), `run(worker, n)` joins the job instead of launching.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib
import io
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 120.0
BACKENDS = ("gloo", "nccl")

# torch.cuda.is_available() and device_count() then ask NVML instead of creating CUDA driver
# state, which would make every later fork unable to use CUDA. Set at import, before any caller
# (a notebook cell, the CLI) can ask.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Messages a rank raises only because *another* rank failed first.
_SECONDARY_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker",
    "broken pipe",
    "socket closed",
    "timed out",
    "timeout",
    "connection refused",
    "read error",
    "write error",
)


class RankError(RuntimeError):
    """A rank raised an exception or died. `rank` and `remote_traceback` say where and how."""

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class Stopped(Exception):
    """Raised by every rank to end a job early on purpose, all agreeing (preemption:
    tpedu.train.preempt.Preempted). `launch` re-raises rank 0's exception itself; under torchrun
    it simply leaves `run` on every rank."""


class LaunchTimeout(TimeoutError):
    """Some ranks did not finish within the timeout (a hang or a mismatched collective)."""


@dataclass
class _Failure:
    rank: int
    kind: str  # "error", "init" (init_process_group itself failed), "died" or "stop" (Stopped)
    exc_type: str
    message: str
    traceback: str
    when: float
    exc: BaseException | None = None  # the Stopped exception itself, for kind "stop"

    @property
    def secondary(self) -> bool:
        text = f"{self.exc_type} {self.message}".lower()
        return self.kind != "died" and any(m in text for m in _SECONDARY_MARKERS)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(world_size: int) -> str:
    """$TPEDU_BACKEND if set (gloo or nccl); else NCCL when there is one GPU per rank, else gloo.
    Does not initialise CUDA."""
    forced = os.environ.get("TPEDU_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"TPEDU_BACKEND={forced!r}: use one of {', '.join(BACKENDS)}")
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another env:// launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def init_from_env(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Join a job whose rank, world size and master address are in the environment (torchrun)."""
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or default_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def run(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    stream: bool = False,
    collective_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Launch `fn` on `world_size` local ranks, or join the job if started by torchrun.

    Returns every rank's result when launched here; under torchrun, a one-element list with this
    rank's own result (other processes hold the rest). Timeouts as in `launch`.
    """
    if not under_torchrun():
        return launch(
            fn,
            world_size,
            *args,
            backend=backend,
            timeout=timeout,
            stream=stream,
            collective_timeout=collective_timeout,
            **kwargs,
        )
    init_from_env(backend, _collective_timeout(timeout, collective_timeout))
    try:
        return [fn(*args, **kwargs)]
    finally:
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    threads: int = 1,
    show_stderr: bool = False,
    stream: bool = False,
    collective_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` forked ranks; return the results in rank order.

    stream=True lets rank 0 write straight to this process's terminal (live progress bars, for
    the CLI); the other ranks' output is still collected and printed afterwards.

    `timeout` bounds the whole run (None: no bound, for long training runs);
    `collective_timeout` (default: `timeout`, or 600 s when that is None) is how long any
    collective may wait for the other ranks before it raises: a hang becomes an error either way.

    Tensors in a result are detached and moved to the CPU. Raises `RankError` if a rank raises or
    dies and `LaunchTimeout` if they do not all finish within `timeout` seconds; either way every
    rank has been killed and joined before the exception reaches you.

    Many parameters because they are the launcher's own settings, each with a default, as
    torchrun's flags are.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this process, so forked ranks cannot use it. "
            "Launch ranks before any CUDA call in this process (restart the kernel), "
            "and let each rank touch its own GPU."
        )
    # Autograd imports this (and sympy, ≈1-5 s) the first time backward gets a non-scalar
    # gradient; importing it once here saves every forked rank from paying for it again.
    importlib.import_module("torch.fx.experimental.symbolic_shapes")

    job = _Job(
        fn,
        args,
        kwargs,
        world_size,
        backend or default_backend(world_size),
        timeout,
        threads,
        stream,
        _collective_timeout(timeout, collective_timeout),
    )
    for attempt in range(3):
        try:
            return _launch_once(job, show_stderr, retry_init=attempt < 2)
        except _PortTaken:  # another process took our free port between probe and bind
            continue
    raise AssertionError("unreachable: the last attempt raises the ranks' own error")


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    world_size: int
    backend: str
    timeout: float | None
    threads: int
    stream: bool = False
    collective_timeout: float = DEFAULT_TIMEOUT


def _collective_timeout(timeout: float | None, collective_timeout: float | None) -> float:
    return collective_timeout or timeout or 600.0


class _PortTaken(Exception):
    pass


def _launch_once(job: _Job, show_stderr: bool, retry_init: bool = True) -> list[Any]:
    ctx = mp.get_context("fork")
    port = free_port()
    outdir = tempfile.mkdtemp(prefix="tpedu-ranks-")
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, Connection] = {}
    failures: list[_Failure] = []
    try:
        for rank in range(job.world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(job, rank, port),
                kwargs={"conn": child_end, "outdir": outdir},
                name=f"tpedu-rank{rank}",
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns[rank] = parent_end
        with _ForwardSigterm(procs, job.collective_timeout) as sigterm:
            results, failures, pending = _collect(procs, conns, job.timeout, sigterm)
    finally:
        _kill_all(procs)
        for c in conns.values():
            c.close()
        # Setting up the process group on our probed port failed on every failing rank (another
        # process bound the port in between, or connected to it: "address already in use",
        # gloo's "connection closed by peer"): no rank ran `fn`, so a new port is a clean retry.
        port_taken = retry_init and bool(failures) and all(f.kind == "init" for f in failures)
        if not port_taken:
            errors = any(f.kind != "stop" for f in failures)
            _print_outputs(outdir, job.world_size, show_stderr or errors)
        _cleanup_dir(outdir)
    if port_taken:
        raise _PortTaken()
    world_size, timeout = job.world_size, job.timeout
    if len(failures) == world_size and all(f.kind == "stop" for f in failures):
        raise min(failures, key=lambda f: f.rank).exc  # every rank stopped on purpose
    if failures and not (pending and all(f.secondary for f in failures)):
        raise _as_rank_error(failures, world_size)
    if pending:
        seen = "".join(
            f"\n  rank {f.rank}: {f.exc_type}: {f.message.splitlines()[0][:160]}" for f in failures
        )
        limit = f"within {timeout:g} s" if timeout is not None else "(a collective timed out)"
        if sigterm.until is not None:
            limit = f"within {job.collective_timeout:g} s of SIGTERM"
        raise LaunchTimeout(
            f"ranks {sorted(pending)} of {world_size} did not finish {limit} "
            "(a hang: a collective that not every rank called, or mismatched send/recv). "
            "All ranks were killed. Raise `timeout=` if the work is just slow."
            + (f"\nranks that gave up waiting:{seen}" if seen else "")
        )
    return [results[r] for r in range(world_size)]


class _ForwardSigterm:
    """While the ranks run: SIGTERM to this process is sent on to every live rank (which may save
    and stop), and sets `until`, the time by which they must have finished. Installed only after
    the ranks are forked (they must not inherit it); a no-op outside the main thread."""

    def __init__(self, procs: list[mp.process.BaseProcess], grace: float) -> None:
        self.procs, self.grace = procs, grace
        self.until: float | None = None
        self.installed, self.previous = False, None

    def __enter__(self) -> _ForwardSigterm:
        with contextlib.suppress(ValueError):  # not the main thread: signals are not ours
            self.previous = signal.signal(signal.SIGTERM, self._forward)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed:  # None: a handler set outside Python; the default is the best guess
            signal.signal(
                signal.SIGTERM, signal.SIG_DFL if self.previous is None else self.previous
            )

    def _forward(self, signum: int, frame: object) -> None:
        if self.until is None:
            self.until = time.monotonic() + self.grace
        for p in self.procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)


def _collect(
    procs: list[mp.process.BaseProcess],
    conns: dict[int, Connection],
    timeout: float | None,
    sigterm: _ForwardSigterm | None = None,
) -> tuple[dict[int, Any], list[_Failure], set[int]]:
    """Wait for every rank's report; stop early (after a short grace) once one fails, or
    `sigterm.grace` seconds after a SIGTERM."""
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    results: dict[int, Any] = {}
    failures: list[_Failure] = []
    waiting = {rank: (conn, procs[rank].sentinel) for rank, conn in conns.items()}
    grace_until: float | None = None
    while waiting:
        now = time.monotonic()
        limit = deadline if grace_until is None else min(deadline, grace_until)
        if sigterm is not None and sigterm.until is not None:
            limit = min(limit, sigterm.until)
        if now >= limit:
            break
        handles = [h for conn, sentinel in waiting.values() for h in (conn, sentinel)]
        ready = set(wait(handles, timeout=min(0.5, limit - now)))
        for rank, (conn, sentinel) in list(waiting.items()):
            if conn in ready:
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    status, payload = "died", None
            elif sentinel in ready:
                status, payload = "died", None
            else:
                continue
            del waiting[rank]
            if status == "ok":
                results[rank] = payload
                continue
            if status in ("error", "init", "stop"):
                failures.append(_Failure(rank, status, *payload))
            else:
                procs[rank].join(timeout=1)
                code = procs[rank].exitcode
                failures.append(
                    _Failure(rank, "died", "ProcessDied", _describe_exit(code), "", time.time())
                )
            if grace_until is None:
                # Let the other ranks report their own errors so the original can be found.
                grace_until = time.monotonic() + 2.0
    return results, failures, set(waiting)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exited without reporting a result"
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name} without reporting a result"
    return f"exited with code {code} without reporting a result"


def _as_rank_error(failures: list[_Failure], world_size: int) -> RankError:
    original = min(failures, key=lambda f: (f.secondary, f.when))
    others = [f for f in failures if f is not original]
    if original.kind == "died":
        head = f"rank {original.rank} of {world_size} {original.message}"
    else:
        head = (
            f"rank {original.rank} of {world_size} raised {original.exc_type}: {original.message}"
        )
    lines = [head]
    if original.traceback:
        lines += ["", f"--- traceback from rank {original.rank} ---", original.traceback.rstrip()]
    if others:
        lines += ["", "other ranks (most likely consequences of the failure above):"]
        lines += [
            f"  rank {f.rank}: {f.exc_type}: {f.message.splitlines()[0][:160]}" for f in others
        ]
    return RankError("\n".join(lines), original.rank, original.traceback)


def _kill_all(procs: list[mp.process.BaseProcess]) -> None:
    """Terminate, then kill, then join every rank: nothing is left running or as a zombie."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 2.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _print_outputs(outdir: str, world_size: int, include_stderr: bool) -> None:
    streams = ["out", "err"] if include_stderr else ["out"]
    for rank in range(world_size):
        for stream in streams:
            path = os.path.join(outdir, f"rank{rank}.{stream}")
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            tag = f"[rank {rank}]" if stream == "out" else f"[rank {rank} stderr]"
            for line in text.splitlines():
                print(f"{tag} {line}")
    sys.stdout.flush()


def _cleanup_dir(path: str) -> None:
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _die_with_parent() -> None:
    """Linux: deliver SIGKILL to this rank if the launching process dies (no orphans)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect_output(outdir: str, rank: int) -> None:
    for fd, stream in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(outdir, f"rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _CPUPickler(pickle.Pickler):
    """Pickles a rank's result with every tensor detached and on the CPU, wherever it sits
    (dicts, dataclasses, namedtuples, ...): unpickling a CUDA tensor in the launching process
    would initialise CUDA there, and no later launch could fork ranks that use it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and (
            obj.device.type != "cpu" or obj.requires_grad or type(obj) is not torch.Tensor
        ):
            return _same, (obj.detach().cpu().as_subclass(torch.Tensor),)
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer).dump(obj)
    return buffer.getvalue()


def _rank_main(job: _Job, rank: int, port: int, *, conn: Connection, outdir: str) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills us on Ctrl-C
    # SIGTERM ends a rank (the default, whatever the parent had) until the work installs its own
    # handler (tpedu.train.preempt): the parent forwards SIGTERM, it does not kill.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not (job.stream and rank == 0):
        _redirect_output(outdir, rank)
    world_size, backend, threads = job.world_size, job.backend, job.threads
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    try:
        if backend == "nccl":
            if torch.cuda._is_in_bad_fork():
                raise RuntimeError(
                    "the launching process initialised CUDA before forking the ranks (a "
                    "torch.cuda call, or a library that made one), so no rank can use its GPU. "
                    "Restart the kernel and let only the ranks touch CUDA."
                )
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=job.collective_timeout)
        try:
            store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        except Exception as e:  # the parent may retry on another port
            info = (type(e).__name__, str(e), traceback.format_exc(), time.time())
            _report(conn, ("init", info), rank)
            _exit()
        result = job.fn(*job.args, **job.kwargs)
        if backend == "nccl":
            torch.cuda.synchronize()
        store.set(f"tpedu/finished/{rank}", "")
        dist.destroy_process_group()
        message = ("ok", result)
    except Stopped as e:  # on purpose, every rank agreeing: the exception itself goes back
        message = ("stop", (type(e).__name__, str(e), traceback.format_exc(), time.time(), e))
    except BaseException as e:  # every failure must reach the parent
        message = ("error", (type(e).__name__, str(e), traceback.format_exc(), time.time()))
    _report(conn, message, rank)
    if rank == 0 and message[0] == "ok":
        _host_the_store_until_all_finished(store, world_size)
    _exit()


def _host_the_store_until_all_finished(store: dist.TCPStore, world_size: int) -> None:
    """Rank 0, its result sent (so another rank's failure is seen as the failure it is), keeps
    the store up until every rank has finished. A rank that never finishes is the launcher's to
    detect: it kills rank 0 with the rest."""
    keys = [f"tpedu/finished/{r}" for r in range(world_size)]
    while not store.check(keys):
        time.sleep(0.005)


def _report(conn: Connection, message: tuple, rank: int) -> None:
    """Send (status, payload) to the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        data = _dumps(message)
    except Exception as e:  # the result itself could not be pickled
        text = f"rank {rank} returned a value that cannot be sent back: {e}"
        data = pickle.dumps(("error", ("PicklingError", text, "", time.time())))
    conn.send_bytes(data)
    conn.close()


def _exit() -> None:
    """End this rank's process, skipping interpreter teardown: atexit hooks inherited from the
    parent (Jupyter, pytest) must not run in a forked child."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

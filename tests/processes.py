"""The process helpers of the launcher and preemption tests: who this process's children are,
killing and reaping what a failing test left, and a script whose sleeping ranks get a signal."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# A generous bound for things that take a second on a quiet machine: ranks starting, a signalled
# script winding down. It is a bound on a hang, not a measurement, so load never reaches it.
STARTUP_S = 60


def children(parent: int | None = None) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is `parent` (default: this one), zombies
    included."""
    me, found = parent or os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            found.append((int(stat.parent.name), fields[0]))
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (the ranks, and anything they started)."""
    found, todo = [], [pid]
    while todo:
        kids = [child for child, _ in children(todo.pop())]
        found += kids
        todo += kids
    return found


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "(a zombie)"


def kill_leftovers() -> list[str]:
    """Kill and reap every child of this process (and their children); return a line per child
    naming its pid, state and command line, so one test's leftover never fails the next."""
    found = children()
    lines = [f"pid {pid} ({state}): {command_line(pid)}" for pid, state in found]
    for pid, _ in found:
        for p in [*descendants(pid), pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid, _ in found:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # already reaped (multiprocessing's own bookkeeping)
            pass
    return lines


def sleeping_ranks_script(pid_dir: Path) -> str:
    """Python that defines `work` for 2 ranks to launch: each writes its pid file into `pid_dir`,
    then sleeps."""
    return textwrap.dedent(f"""
        import os, time
        import tpedu

        def work():
            open(os.path.join({str(pid_dir)!r}, f"pid{{os.getpid()}}"), "w").close()
            time.sleep(600)
    """)


def wait_for_ranks(pid_dir: Path, n: int = 2) -> list[int]:
    """The pids of the `n` ranks once each has written its pid file into `pid_dir`."""
    deadline = time.monotonic() + STARTUP_S
    while len(list(pid_dir.glob("pid*"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.name[3:]) for p in pid_dir.glob("pid*")]
    assert len(pids) == n, f"the ranks did not start within {STARTUP_S} s"
    return pids


def signal_sleeping_ranks(tmp_path: Path, sig: signal.Signals, catch: str, say: str):
    """Start a script that launches 2 sleeping ranks; once both run, send `sig` to the script.
    It catches `catch` and prints `say` (a Python expression over the exception `e`). Returns
    (its stdout, the ranks' pids).

    The script sets SIGINT's handler itself, as a terminal's Python and a kernel running a cell
    have it: a caller started as a background job ignores SIGINT, and that would be inherited."""
    script = sleeping_ranks_script(tmp_path) + textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            tpedu.launch(work, 2, timeout=600)
        except {catch} as e:
            print({say}, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = wait_for_ranks(tmp_path)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=STARTUP_S)
    finally:
        if proc.poll() is None:  # the ranks die with it (PR_SET_PDEATHSIG)
            proc.kill()
            proc.communicate()
    return out, pids

"""Child processes that end with the thread that started them (the Prefect server of `moplex run`, the
vLLM worker), the signals that stop a `moplex` command the way Ctrl-C does (`StopSignal`), and a
name for a process that outlives it (`process_identity`, `process_running`).

On Linux the child first runs a few lines of Python in its own process: ask the kernel for SIGTERM
when the parent thread ends (prctl PR_SET_PDEATHSIG, kept across exec), give up if the parent has
already ended, then become the real command (exec: same pid, so signals and exit statuses are the
command's own). No preexec_fn, which runs Python in the forked child of a threaded process.
Elsewhere the command starts as it is.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_STOP_WITH_PARENT = f"""
import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, {int(signal.SIGTERM)})
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def popen_ending_with_this_thread(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen` of ``args`` that gets SIGTERM when the calling thread ends, however it ends
    (SIGKILL of the whole process included), on Linux. Only for a child the calling thread needs no
    longer than it lives itself. ``args[0]`` is looked up on PATH; a missing program makes the child
    exit with status 1 and a traceback on its stderr, not an OSError here."""
    if sys.platform.startswith("linux"):
        args = [sys.executable, "-c", _STOP_WITH_PARENT, str(os.getpid()), *map(str, args)]
    return subprocess.Popen(list(args), **kwargs)


def process_identity(pid: int | None = None) -> str:
    """``host/pid/start`` of process ``pid`` (default: this one) on this machine: its start in clock
    ticks after boot (Linux's /proc/PID/stat), which tells it from a later process given the same pid;
    ``-`` where there is no /proc."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}/{pid}/{_start_ticks(pid) or '-'}"


def process_running(identity: str) -> bool | None:
    """Whether the process `process_identity` named is running (None: another machine's, or a name
    not of that form, about which nothing can be said here)."""
    host, _, rest = identity.partition("/")
    pid, _, start = rest.partition("/")
    if host != socket.gethostname() or not pid.isdigit() or not start:
        return None
    now = _start_ticks(int(pid))
    if start != "-":
        return now == start
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    return True


def _start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (after the command's name, which may hold spaces and parentheses),
    or None: no such process, or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


FLOW_HEARTBEAT_SECONDS = 30
"""PREFECT_FLOWS_HEARTBEAT_FREQUENCY of moplex's flow runs against a server (prefect.yaml sets it for the
deployments; `moplex run` and the retry command it prints for its own): prefect-automations.yaml marks a
run silent for 90 s Crashed, and Prefect's default of 180 s would take a live run for a dead one."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def stop_on_signals_until_exit() -> None:
    """SIGTERM, SIGHUP and SIGINT raise `StopSignal` in this (the main) thread from now until the
    interpreter's exit hooks have run, Prefect's stopping of its temporary server included (hooks
    run last registered first, and Prefect registers its own when the server starts, after this).
    Prefect's engine, having recorded a crash, hands SIGTERM back to the handler it found; the
    default one would end the process on the spot, before those hooks. SIGINT (Ctrl-C) is taken too:
    with Python's own handler in place, an `asyncio.run` in the main thread swaps in one that only
    cancels its task, so a SIGINT landing there is lost if the cancellation is absorbed (seen once: a
    `moplex run` signalled as its train stage began ran on to the end)."""
    if any(signal.getsignal(signum) is _raise_stop_signal for signum in STOP_SIGNALS):
        return
    previous = {signum: signal.signal(signum, _raise_stop_signal) for signum in STOP_SIGNALS
                if signal.getsignal(signum) is not signal.SIG_IGN}  # nohup's SIGHUP stays ignored
    atexit.register(lambda: [signal.signal(signum, handler) for signum, handler in previous.items()])


class StopSignal(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGINT during a `moplex` command, raised as Ctrl-C's KeyboardInterrupt is,
    with the exit status a signal gives (128 + its number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum, self.status = signum, 128 + signum

    def __reduce__(self) -> tuple[type[StopSignal], tuple[int]]:
        return StopSignal, (self.signum,)


def _raise_stop_signal(signum: int, frame: object) -> None:
    raise StopSignal(signum)

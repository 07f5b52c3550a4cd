"""Child processes that end with the thread that started them (the Prefect server of `moplex run`, the
vLLM worker).

On Linux the child first runs a few lines of Python in its own process: ask the kernel for SIGTERM
when the parent thread ends (prctl PR_SET_PDEATHSIG, kept across exec), give up if the parent has
already ended, then become the real command (exec: same pid, so signals and exit statuses are the
command's own). No preexec_fn, which runs Python in the forked child of a threaded process.
Elsewhere the command starts as it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
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

"""Freezes and thaws processes on command (``python -m bench _freezer PID ...``), for the
stalled-relay regime: SIGSTOP stands in for a VM stall, a debugger or a long GC pause.

It is a process of its own so that a frozen relay is never left behind: the bench's children
get SIGTERM when the bench dies, and a stopped process keeps that signal pending until it is
continued. This process gets it too, and continues every process it was given before it
exits (on SIGTERM, SIGHUP, the end of its input, or an error), so a relay frozen at that moment
wakes up and ends. It only ever signals the pids on its command line.

Line protocol (JSON lines on stdout, commands on stdin):

    -> {"ready": true}
    <- stop 1              SIGSTOP to the second pid; answered once /proc says it is stopped
    -> {"stopped": 1, "t": <monotonic ns>, "confirmed": true}
    <- cont                SIGCONT to every pid
    -> {"continued": [1], "t": <monotonic ns>}
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

_CONFIRM_S = 1.0  # how long to wait for /proc to show the process stopped


def _state(pid: int) -> str | None:
    """The process state letter of proc(5) (``T``: stopped), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _signal(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _stop(pid: int) -> bool:
    """SIGSTOP, then wait (bounded) until the kernel shows the process stopped."""
    if not _signal(pid, signal.SIGSTOP):
        return False
    deadline = time.monotonic() + _CONFIRM_S
    while time.monotonic() < deadline:
        state = _state(pid)
        if state is None:
            return False
        if state in ("T", "t"):
            return True
        time.sleep(0.001)
    return False


def _say(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """Entry point of ``python -m bench _freezer PID ...``."""
    pids = [int(a) for a in argv]
    frozen: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    try:
        _say({"ready": True})
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "stop":
                k = int(words[1])
                confirmed = _stop(pids[k])
                frozen.add(k)
                _say({"stopped": k, "t": time.monotonic_ns(), "confirmed": confirmed})
            elif words[0] == "cont":
                for k in sorted(frozen):
                    _signal(pids[k], signal.SIGCONT)
                t = time.monotonic_ns()
                _say({"continued": sorted(frozen), "t": t})
                frozen.clear()
            else:
                _say({"error": f"unknown command {words[0]!r}"})
    finally:
        # Whatever ended this process: nothing it froze stays frozen.
        for pid in pids:
            _signal(pid, signal.SIGCONT)
    return 0

"""py-spy profiles of a mode's process, and their summary: the functions with the most own
(self) time.

``py-spy record --format raw`` writes collapsed stacks, one line per distinct stack:
``frame;frame;...;leaf count``. A sample's own time belongs to its leaf frame, so the top
functions by own time are the leaf frames summed over lines. Idle time (a thread blocked in
``epoll_wait``) is left out by py-spy unless ``--idle`` is given, so the shares are of the
samples in which the process ran Python code or a native call from it.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_RATE = 250  # samples per second


def find_py_spy() -> str | None:
    """The py-spy executable (on PATH or next to this interpreter), or None."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


async def start_profiler(pid: int, out: Path) -> asyncio.subprocess.Process | None:
    """Record ``pid`` into ``out`` (raw collapsed stacks) until ``stop_profiler``; None when
    py-spy is not installed."""
    spy = find_py_spy()
    if spy is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return await asyncio.create_subprocess_exec(
        spy,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(_RATE),
        # Only samples that hold the GIL: py-spy takes a thread waiting in uvloop's epoll
        # (which releases the GIL) for a running one, and idle time flooded the profile.
        "--gil",
        "--format",
        "raw",
        "--output",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def stop_profiler(proc: asyncio.subprocess.Process) -> None:
    """Let py-spy write its file: it does so on SIGINT, or when the process it records exits."""
    if proc.returncode is None:
        proc.send_signal(2)
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def _leaf(stack: str) -> str:
    frame = stack.rsplit(";", 1)[-1]
    # "func (path/to/module.py:123)": keep the function and the file, drop the line.
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/notify_outbox/", "/python3.11/", "/bench/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/notify_outbox/":
                path = "notify_outbox/" + path
            break
    return f"{name} ({path})" if path else name


def top_self(raw: Path, limit: int = 15) -> dict[str, Any]:
    """The ``limit`` functions with the most own samples in a raw py-spy profile (``top``),
    and with the most samples in which they are anywhere on the stack (``inclusive``), each
    with its share of all samples."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        own[_leaf(frames[-1])] += int(n)
        for f in {_leaf(f) for f in frames}:
            anywhere[f] += int(n)
        total += int(n)

    def rows(counts: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"function": f, "samples": c, "share": c / total if total else 0.0}
            for f, c in counts.most_common(limit)
        ]

    return {"samples": total, "top": rows(own), "inclusive": rows(anywhere)}

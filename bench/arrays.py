"""How the bench's processes hand each other per-event data: named int64 arrays in one file
(a JSON header line with names and lengths, then the raw arrays)."""

from __future__ import annotations

import json
from array import array
from pathlib import Path


def new_array(n: int = 0) -> array[int]:
    """An int64 array of ``n`` zeros."""
    a: array[int] = array("q")
    if n:
        a.frombytes(bytes(8 * n))
    return a


def save_arrays(path: Path, arrays: dict[str, array[int]]) -> None:
    """Write ``arrays`` to ``path`` (atomically: a reader never sees half a file)."""
    header = {name: len(a) for name, a in arrays.items()}
    tmp = path.with_name(path.name + ".part")
    with tmp.open("wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        for a in arrays.values():
            a.tofile(fh)
    tmp.replace(path)


def load_arrays(path: Path) -> dict[str, array[int]]:
    """Read what ``save_arrays`` wrote."""
    with path.open("rb") as fh:
        header = json.loads(fh.readline())
        out: dict[str, array[int]] = {}
        for name, n in header.items():
            a: array[int] = array("q")
            a.fromfile(fh, int(n))
            out[name] = a
    return out

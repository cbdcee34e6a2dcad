"""Where a claim's time goes: one line per claim, for the bench's stage breakdown.

Off unless ``NOTIFY_OUTBOX_STAGE_LOG`` names a file: the relay then appends, for every claim
that returned rows, a JSON object with the claim's stage times (``time.monotonic_ns()``, which
is one clock for every process of a Linux host) and its rows' payloads, so that the bench can
join them with its own commit acks and consumer receipts (``bench/stages.py``). Nothing of it
runs when the variable is unset: the relay only tests for ``None``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import IO

from notify_outbox.core.outbox import OutboxRow

__all__ = ["STAGE_LOG_ENV", "StageLog", "open_stage_log"]

STAGE_LOG_ENV = "NOTIFY_OUTBOX_STAGE_LOG"


class StageLog:
    """An open stage log: ``claim`` writes one line (line-buffered: a killed relay loses at
    most the line being written)."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def claim(
        self,
        *,
        src: str,
        notified: int | None,
        woken: int,
        start: int,
        rows_at: int,
        handed: int | None,
        acked: int,
        marked: int,
        rows: Sequence[OutboxRow],
    ) -> None:
        """One claim: what started it (``src``, a wake source or why its worker claimed
        again), when the notification behind it arrived (``notified``, or None), when its
        worker was woken (``woken``), BEGIN (``start``), the rows returned (``rows_at``),
        the last record handed to the producer (``handed``; None: nothing was sent), the
        last ack (``acked``) and the mark's commit (``marked``)."""
        line = {
            "src": src,
            "notified": notified,
            "woken": woken,
            "start": start,
            "rows": rows_at,
            "handed": handed,
            "acked": acked,
            "marked": marked,
            "payloads": [r.payload for r in rows],
        }
        self._out.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._out.close()


def open_stage_log() -> StageLog | None:
    """The stage log ``NOTIFY_OUTBOX_STAGE_LOG`` names, opened for appending; None when unset."""
    path = os.environ.get(STAGE_LOG_ENV)
    if not path:
        return None
    return StageLog(open(path, "a", buffering=1, encoding="utf-8"))  # closed by the relay

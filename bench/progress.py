"""Progress on stderr: a live status line on a terminal, plus one permanent line per cell."""

from __future__ import annotations

import shutil
import sys
import time


class Progress:
    """``status()`` rewrites the live line (terminal only); ``line()`` prints a lasting one."""

    def __init__(self, *, total_cells: int = 0) -> None:
        self.start = time.monotonic()
        self.total = total_cells
        self.done = 0
        self._live = sys.stderr.isatty()
        self._shown = False

    def _stamp(self) -> str:
        s = int(time.monotonic() - self.start)
        cells = f" {self.done}/{self.total}" if self.total else ""
        return f"[{s // 60:02d}:{s % 60:02d}{cells}]"

    def _clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\x1b[2K")
            self._shown = False

    def status(self, text: str) -> None:
        """Show what is happening now."""
        if not self._live:
            return
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self._clear()
        sys.stderr.write(f"{self._stamp()} {text}"[:width])
        sys.stderr.flush()
        self._shown = True

    def line(self, text: str, *, cell: bool = False) -> None:
        """Print a lasting line (``cell``: one more cell is done)."""
        if cell:
            self.done += 1
        self._clear()
        sys.stderr.write(f"{self._stamp()} {text}\n")
        sys.stderr.flush()

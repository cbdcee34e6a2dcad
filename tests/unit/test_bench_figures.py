"""The README's and docs/benchmarks.md's headline figures are the results files' (bench/figures.py):
a figure edited by hand, or a results file pointed at without regenerating, fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import figures


def test_the_pages_show_the_results_figures() -> None:
    stale = [str(p.relative_to(figures.ROOT)) for p in figures.check()]
    assert not stale, f"figures out of date in {stale}: run `{figures.REGENERATE}`"


def test_a_figure_edited_by_hand_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = tmp_path / "README.md"
    text = figures.PAGES[0].read_text(encoding="utf-8")
    row = next(line for line in figures.render().splitlines() if line.startswith("| commit"))
    shown = f"| {row.split(' | ')[1]} |"  # the relay's latency at the first load
    assert shown in text
    readme.write_text(text.replace(shown, "| 0.01 / 0.02 |"), encoding="utf-8")
    monkeypatch.setattr(figures, "PAGES", (readme,))
    assert figures.check() == [readme]
    figures.update()
    assert figures.check() == []
    assert shown in readme.read_text(encoding="utf-8")

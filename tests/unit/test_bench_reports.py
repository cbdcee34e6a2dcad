"""Every stored bench result still renders: ``python -m bench report`` on each
``bench/results/*.json`` writes its markdown (plots left out: matplotlib is slow), and the
regimes' terminal tables come out of it. Old results must stay readable as the bench changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.catalog import REGIMES, write_report

RESULTS = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("*.json"))


def test_there_are_stored_results() -> None:
    assert len(RESULTS) > 10
    phases = {json.loads(p.read_text()).get("phase") for p in RESULTS}
    assert set(REGIMES) <= phases, "a regime has no stored result to render"


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_a_stored_result_renders(path: Path, tmp_path: Path) -> None:
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    md = write_report(copy, plots=False)
    text = md.read_text()
    assert text.startswith("# ")
    assert text.endswith("\n")
    result = json.loads(path.read_text())
    regime = REGIMES.get(result.get("phase") or "")
    if regime is not None and regime.terminal:
        lines = regime.terminal_lines(result)
        assert lines
        assert lines[0].startswith("## "), lines[:3]

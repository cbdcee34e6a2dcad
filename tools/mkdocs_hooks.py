"""MkDocs hooks of the docs site (mkdocs.yml ``hooks:``).

The benchmark history and the plots live where the bench writes them, in ``bench/results/``
(outside ``docs/``); this hook serves ``HISTORY.md`` and every ``.png`` there under the same
path, ``bench/results/``, so that the benchmarks page can link and embed them and the history's
own relative image links work on the site as they do in the repository.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
#: Where the files appear on the site (and in docs/ links): the repository's own layout.
SITE_PATH = "bench/results"


def result_files() -> list[Path]:
    """The files of bench/results/ the site serves: the history and every plot."""
    return [RESULTS / "HISTORY.md", *sorted(RESULTS.glob("*.png"))]


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    """Add the files of ``result_files`` to the site under ``bench/results/``."""
    for path in result_files():
        files.append(File.generated(config, f"{SITE_PATH}/{path.name}", abs_src_path=str(path)))
    return files

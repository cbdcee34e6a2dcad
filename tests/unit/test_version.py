"""One version: the package's ``__version__``, the installed metadata and ``--version``."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

import notify_outbox
from notify_outbox.cli.app import main


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"notify-outbox {notify_outbox.__version__}\n"


def test_python_m_version_agrees_with_the_installed_metadata() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "notify_outbox", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"notify-outbox {notify_outbox.__version__}\n"
    # pyproject reads __version__ (dynamic version), so the installed metadata says the same.
    assert version("notify-outbox") == notify_outbox.__version__

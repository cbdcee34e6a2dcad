"""The installed package applies the SQL, so the wheel must carry it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from notify_outbox.pg.sqlfiles import load_migrations, sql_dir

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_sql(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("notify_outbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(sql_dir()).as_posix() for p in sql_dir().rglob("*.sql")}
    assert shipped >= {"queries.sql", "grants.sql", "migrations/0001_outbox.sql"}
    for rel in shipped:
        assert f"notify_outbox/sql/{rel}" in names
    assert "notify_outbox/py.typed" in names
    assert not any(n.startswith(("devstack/", "tests/")) for n in names)


def test_migrations_are_numbered_without_gaps() -> None:
    versions = [m.version for m in load_migrations()]
    assert versions == list(range(1, len(versions) + 1))

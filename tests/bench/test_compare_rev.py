"""``--compare-rev``: the worktree of another revision made and removed around a run, the
``-alt`` modes added beside the selected ones, and the revisions named in the result. No
services."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from bench.cli import _parser
from bench.drain import alt_drain_mode
from bench.revs import compare_tree, label_modes, revision_text, with_alt_modes
from tests.support import ROOT


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_worktree_holds_the_revision_and_is_removed_at_the_end() -> None:
    head = _git("rev-parse", "HEAD")
    with compare_tree("HEAD") as alt:
        assert alt is not None
        assert alt.revision == head
        assert alt.subject == _git("log", "-1", "--format=%s", "HEAD")
        assert (alt.tree / "notify_outbox" / "__main__.py").is_file()
        assert _git("-C", str(alt.tree), "rev-parse", "HEAD") == head
        assert str(alt.tree) in _git("worktree", "list")
        tree = alt.tree
    assert not tree.exists()
    assert not tree.parent.exists()
    assert str(tree) not in _git("worktree", "list")
    with compare_tree(None) as nothing:
        assert nothing is None


def test_a_failing_run_removes_the_worktree_too() -> None:
    trees = []

    def run() -> None:
        with compare_tree("HEAD") as alt:
            assert alt is not None
            trees.append(alt.tree)
            raise RuntimeError("the run broke")

    with pytest.raises(RuntimeError, match="the run broke"):
        run()
    (tree,) = trees
    assert not tree.exists()
    assert str(tree) not in _git("worktree", "list")


def test_an_unknown_revision_is_refused() -> None:
    from bench.procs import BenchError

    with pytest.raises(BenchError, match="no-such-revision"), compare_tree("no-such-revision"):
        pass


def test_alt_modes_beside_the_selected_ones_unless_named() -> None:
    def run_alt(m: str) -> str | None:
        return f"{m}-alt" if m.startswith("notify") or m == "relay-poll" else None

    assert with_alt_modes(["floor", "notify", "relay-poll", "poll-100ms"], run_alt) == [
        "floor",
        "notify",
        "notify-alt",
        "relay-poll",
        "relay-poll-alt",
        "poll-100ms",
    ]
    assert with_alt_modes(["notify", "notify-alt"], run_alt) == ["notify", "notify-alt"]
    # notify-always is no -alt mode.
    assert with_alt_modes(["notify-always"], run_alt) == ["notify-always", "notify-always-alt"]
    assert with_alt_modes(["relay-1", "relay-2-pgbouncer", "poller"], alt_drain_mode) == [
        "relay-1",
        "relay-1-alt",
        "relay-2-pgbouncer",
        "relay-2-alt-pgbouncer",
        "poller",
    ]
    assert with_alt_modes(["relay-1", "relay-1-alt-pgbouncer"], alt_drain_mode) == [
        "relay-1",
        "relay-1-alt-pgbouncer",
    ]


def test_every_mode_names_its_revision() -> None:
    alt = {"ref": "main", "revision": "a" * 40, "subject": "the claim before"}
    result: dict[str, Any] = {
        "config": {"alt_relay": "/tmp/rev/aaaa", "alt_revision": alt},
        "environment": {"git": {"revision": "b" * 40, "subject": "this change", "dirty": True}},
        "modes": {"notify": {"cwd": None}, "notify-alt": {"cwd": "/tmp/rev/aaaa"}},
    }
    label_modes(result)
    assert result["modes"]["notify-alt"]["revision"] == alt
    assert result["modes"]["notify"]["revision"] == {
        "revision": "b" * 40,
        "subject": "this change",
        "dirty": True,
    }
    assert revision_text(result["modes"]["notify"]["revision"]) == (
        f"revision {'b' * 40} “this change” (uncommitted changes)"
    )
    recovery: dict[str, Any] = {
        "config": {"alt_relay": "/tmp/rev/aaaa", "alt_revision": alt},
        "environment": {"git": {}},
        "mode": {"cwd": "/tmp/rev/aaaa"},
    }
    label_modes(recovery)
    assert recovery["mode"]["revision"] == alt


@pytest.mark.parametrize(
    "command",
    ["run", "drain", "recovery", "held-snapshot", "failing-head", "stalled-relay"],
)
def test_compare_rev_and_alt_relay_are_exclusive(command: str) -> None:
    assert _parser().parse_args([command, "--compare-rev", "main"]).compare_rev == "main"
    with pytest.raises(SystemExit) as e:
        _parser().parse_args([command, "--compare-rev", "main", "--alt-relay", "/tmp/x"])
    assert e.value.code == 2

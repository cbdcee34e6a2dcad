"""``--compare-rev REV``: another revision of the relay, checked out as a detached ``git
worktree`` in a temporary directory for one run, and run as ``--alt-relay`` runs a tree (the
``*-alt`` modes); removed again when the run ends, however it ends."""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.envinfo import git_output


@dataclass(frozen=True)
class AltRevision:
    """A worktree of ``ref``: where it is, and the revision it holds."""

    tree: Path
    ref: str
    revision: str  # the full hash
    subject: str  # git log -1 --format=%s

    def to_json(self) -> dict[str, str]:
        """What the result records (the tree is gone by the time anyone reads it)."""
        return {"ref": self.ref, "revision": self.revision, "subject": self.subject}


@contextlib.contextmanager
def compare_tree(ref: str | None) -> Iterator[AltRevision | None]:
    """A detached worktree of ``ref`` (None: no comparison, nothing made), removed with
    ``git worktree remove --force`` at the end."""
    if ref is None:
        yield None
        return
    # --end-of-options: a ref that starts with "-" is a ref, not an option.
    revision = git_output("rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}")
    subject = git_output("log", "-1", "--format=%s", revision)
    parent = Path(tempfile.mkdtemp(prefix="notify-outbox-bench-rev-"))
    tree = parent / revision[:12]
    try:
        git_output("worktree", "add", "--detach", str(tree), revision)
        yield AltRevision(tree, ref, revision, subject)
    finally:
        if tree.exists():
            try:
                git_output("worktree", "remove", "--force", str(tree))
            except Exception as e:  # the run's own outcome matters more; say what is left
                print(f"bench: could not remove the worktree {tree}: {e}", file=sys.stderr)
        shutil.rmtree(parent, ignore_errors=True)


def with_alt_modes(modes: list[str], alt_of: Callable[[str], str | None]) -> list[str]:
    """``modes``, each followed by its ``-alt`` counterpart (``alt_of``; None: it has none),
    unless some ``-alt`` mode is named already: then the choice is the user's."""
    if any(re.search(r"-alt(-|$)", m) for m in modes):
        return modes
    out: list[str] = []
    for m in modes:
        out.append(m)
        if (alt := alt_of(m)) is not None:
            out.append(alt)
    return list(dict.fromkeys(out))


def label_modes(result: dict[str, Any]) -> None:
    """With ``--compare-rev``, every mode record of ``result`` names the revision it ran:
    the compared one for the modes run from its tree, this checkout's (and whether it had
    uncommitted changes) for the others."""
    cfg = result["config"]
    alt = cfg.get("alt_revision")
    if not alt:
        return
    git = result.get("environment", {}).get("git", {})
    here = {k: git.get(k) for k in ("revision", "subject", "dirty")}
    records = list(result.get("modes", {}).values())
    if isinstance(result.get("mode"), dict):  # recovery: one relay
        records.append(result["mode"])
    for m in records:
        m["revision"] = dict(alt) if m.get("cwd") == cfg.get("alt_relay") else dict(here)


def revision_text(rev: dict[str, Any]) -> str:
    """A revision record as the reports print it: full hash, subject, dirty."""
    return f"revision {rev.get('revision')} “{rev.get('subject')}”" + (
        " (uncommitted changes)" if rev.get("dirty") else ""
    )

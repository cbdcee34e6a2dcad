"""Moved to ``notify_outbox.ops.replay``; this module re-exports its public names."""

from .ops.replay import (
    NothingToReplay,
    ReplayReport,
    replay,
)

__all__ = [
    "NothingToReplay",
    "ReplayReport",
    "replay",
]

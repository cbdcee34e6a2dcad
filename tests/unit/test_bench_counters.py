"""The bench's statement counts between two readings of ``pg_stat_statements``."""

from __future__ import annotations

from bench.services import statements_delta


def test_statements_are_counted_only_while_no_entry_was_evicted() -> None:
    assert statements_delta({"calls": 10, "dealloc": 3}, {"calls": 14, "dealloc": 3}) == 4
    # Entries evicted in the window took their calls along: no count, not a wrong one (a long
    # lived server once gave -5.70 queries/s).
    assert statements_delta({"calls": 900, "dealloc": 3}, {"calls": 843, "dealloc": 4}) is None
    assert statements_delta({"calls": 900, "dealloc": 3}, {"calls": 950, "dealloc": 4}) is None
    # A sum that went down is never a count, whatever the reason.
    assert statements_delta({"calls": 900, "dealloc": 3}, {"calls": 843, "dealloc": 3}) is None
    # Not counted at all (no pg_stat_statements).
    assert statements_delta({"calls": None}, {"calls": None}) is None

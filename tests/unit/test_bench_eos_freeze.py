"""The eos-freeze regime's analysis of the LSO looks (``bench/eos_freeze.py``): stalls, the
one the frozen transaction made, the stored series, and the bound."""

from __future__ import annotations

import pytest

from bench.eos_freeze import (
    Stall,
    analyse_lso,
    changes,
    expected_bound,
    freeze_stall,
    parse_setting,
    stalls,
)
from bench.procs import BenchError

S = 1_000_000_000


def test_a_short_transaction_and_a_frozen_one_make_a_stall_each() -> None:
    looks = [
        (0 * S, 10, 10),
        (1 * S, 12, 11),  # a healthy transaction open at this look
        (2 * S, 13, 13),
        (3 * S, 15, 14),  # the frozen one: the LSO stays at 14 ...
        (4 * S, 20, 14),
        (5 * S, 30, 14),
        (6 * S, 31, 31),  # ... until it is aborted
    ]
    assert stalls(looks) == [
        Stall(1 * S, 2 * S, 11, 1, True),
        Stall(3 * S, 6 * S, 14, 16, True),
    ]


def test_a_stall_that_moves_to_another_offset_is_a_new_one() -> None:
    looks = [(0, 5, 3), (S, 8, 6), (2 * S, 8, 8)]
    assert stalls(looks) == [Stall(0, S, 3, 2, True), Stall(S, 2 * S, 6, 2, True)]


def test_a_stall_still_there_at_the_last_look_has_not_ended() -> None:
    assert stalls([(0, 1, 1), (S, 3, 1), (2 * S, 9, 1)]) == [Stall(S, 2 * S, 1, 8, False)]
    assert stalls([]) == []


def test_the_frozen_transaction_s_stall_began_by_the_stop_and_outlasted_it() -> None:
    before = Stall(0, 1 * S, 1, 1, True)  # over before the stop
    frozen = Stall(9 * S, 20 * S, 2, 50, True)
    later = Stall(15 * S, 30 * S, 3, 9, True)  # began well after the stop: another's
    found = [before, frozen, later]
    assert freeze_stall(found, 10 * S, S // 4) is frozen
    # A partition it did not write to: only stalls that began later.
    assert freeze_stall([before, later], 10 * S, S // 4) is None


def test_analyse_lso_per_partition() -> None:
    t_base, t_arm, t_stop = 0, 10 * S, 11 * S
    written = [(0, 1, 1), (2 * S, 3, 2), (3 * S, 3, 3), (t_stop - S // 10, 5, 4)]
    written += [(t_stop + k * S, 5 + k, 4) for k in range(1, 8)] + [(t_stop + 8 * S, 13, 13)]
    quiet = [(t, hw, hw) for t, hw, _ in written]
    out = analyse_lso({"t[0]": written, "t[1]": quiet}, t_base, t_arm, t_stop)
    p = out["partitions"]["t[0]"]
    assert (p["stalled"], p["held_s"], p["max_lag"], p["ended"]) == (True, 8.0, 8, True)
    assert (p["baseline_stalls"], p["baseline_longest_s"]) == (1, 1.0)
    assert not out["partitions"]["t[1]"]["stalled"]
    assert out["held_max_s"] == 8.0


def test_changes_keep_the_stalls() -> None:
    looks = [(0, 1, 1), (S // 2, 1, 1), (S, 4, 2), (3 * S // 2, 6, 2), (2 * S, 6, 6), (3 * S, 6, 6)]
    stored = changes(looks, 0)
    assert stored == [[0, 1, 1], [1000, 4, 2], [1500, 6, 2], [2000, 6, 6], [3000, 6, 6]]
    again = [(t * 1_000_000, hw, lso) for t, hw, lso in stored]
    assert stalls(again) == stalls(looks)


def test_the_bound_is_the_earlier_of_the_broker_s_abort_and_the_takeover() -> None:
    assert expected_bound(10, 10) == {
        "by_broker_s": 20.0,
        "by_takeover_s": pytest.approx(10 + 10 / 3),
        "bound_s": pytest.approx(10 + 10 / 3 + 1),
    }
    assert expected_bound(3, 3)["bound_s"] == pytest.approx(5.0)
    assert expected_bound(3, 30)["bound_s"] == pytest.approx(14.0)  # the broker's, 3 + 10 + 1


def test_parse_setting() -> None:
    assert parse_setting("10/10") == (10.0, 10.0)
    for bad in ("10", "0.5/3", "3/0", "a/b"):
        with pytest.raises(BenchError):
            parse_setting(bad)

"""The claim's result is read by name: its leading columns must be OutboxRow's fields."""

from __future__ import annotations

import dataclasses

import pytest

from notify_outbox.core.errors import MigrationError
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.pg.store import _check_row_columns

FIELDS = [f.name for f in dataclasses.fields(OutboxRow)]


def test_the_claims_columns_are_outbox_rows_fields_then_the_mark() -> None:
    _check_row_columns([*FIELDS, "next_low", "next_xids", "next_lows", "changed", "busy"])


def test_a_column_out_of_place_is_refused() -> None:
    swapped = [FIELDS[1], FIELDS[0], *FIELDS[2:], "next_low"]
    with pytest.raises(MigrationError, match="claim function and this relay disagree"):
        _check_row_columns(swapped)

"""The drain's ``-avro`` modes: parsed beside the existing names, described and given the
registry's URL on top of ``--relay-env``; the tally consumer reads ``s`` from Avro-framed
values as from JSON; issue 33's target in the summary. No services."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_writer

from bench.drain import alt_drain_mode, mode_env, parse_mode, problems, summarize
from bench.drain_schema import DRAIN_AVRO_SCHEMA
from bench.procs import BenchError
from bench.tally import Tally, framed, sequence

_URL = "http://127.0.0.1:1/apis/ccompat/v7"
_HEADER = "outbox-event-id"


def _avro(g: int, s: int, schema_id: int = 7) -> bytes:
    body = io.BytesIO()
    schemaless_writer(body, parse_schema(DRAIN_AVRO_SCHEMA), {"g": g, "s": s, "p": "x" * 170})
    return b"\0" + schema_id.to_bytes(4, "big") + body.getvalue()


def test_avro_modes_are_parsed_beside_the_existing_names() -> None:
    dm = parse_mode("relay-1-avro", None)
    assert (dm.name, dm.processes, dm.avro, dm.mode.kind) == ("relay-1-avro", 1, True, "relay")
    assert "Avro" in dm.mode.description
    assert "Schema Registry" in dm.mode.description
    assert dm.to_json()["avro"] is True
    alt = parse_mode("relay-2-alt-pgbouncer-avro", "/tmp/relay-b")
    assert (alt.processes, alt.avro, alt.mode.cwd, alt.mode.pgbouncer) == (
        2,
        True,
        "/tmp/relay-b",
        True,
    )
    for name in ("relay-1", "relay-2-alt", "relay-1-pgbouncer", "poller"):
        plain = parse_mode(name, "/tmp/relay-b")
        assert plain.name == name
        assert not plain.avro
        assert "Avro" not in plain.mode.description
    for bad in ("relay-1-avro-alt", "relay-1-avro-pgbouncer", "poller-avro", "relay-0-avro"):
        with pytest.raises(BenchError, match="unknown drain mode"):
            parse_mode(bad, "/tmp/relay-b")
    with pytest.raises(BenchError, match="--alt-relay"):
        parse_mode("relay-1-alt-avro", None)
    assert alt_drain_mode("relay-1-avro") == "relay-1-alt-avro"
    assert alt_drain_mode("relay-2-pgbouncer-avro") == "relay-2-alt-pgbouncer-avro"
    assert alt_drain_mode("relay-1-alt-avro") is None


def test_an_avro_mode_gets_the_registry_url_on_top_of_relay_env() -> None:
    relay_env = {"NOTIFY_OUTBOX_WORKERS": "8"}
    assert mode_env(parse_mode("relay-1-avro", None), relay_env, _URL) == {
        "NOTIFY_OUTBOX_WORKERS": "8",
        "NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL": _URL,
    }
    assert relay_env == {"NOTIFY_OUTBOX_WORKERS": "8"}  # merged into a copy
    assert mode_env(parse_mode("relay-1", None), relay_env, _URL) == relay_env
    assert mode_env(parse_mode("poller", None), relay_env, _URL) == {}
    with pytest.raises(BenchError, match="Schema Registry"):
        mode_env(parse_mode("relay-1-avro", None), relay_env, None)


def test_tally_reads_s_from_avro_framed_values() -> None:
    assert framed(_avro(1, 3))
    assert sequence(_avro(1, 3)) == 3
    assert not framed(b'{"g": 1, "s": 4, "p": ""}')
    assert sequence(b'{"g": 1, "s": 4}') == 4
    assert not framed(b"\0\0\0\0")  # too short for a schema id: read as JSON (and fails)
    with pytest.raises(ValueError, match="not a drain Avro record"):
        sequence(_avro(1, 3)[:8])  # a truncated body is unreadable, not a crash
    tally = Tally()
    for i, (key, value) in enumerate(
        [
            (b"k1", _avro(1, 1)),
            (b"k1", _avro(2, 2)),
            (b"k2", _avro(3, 1)),
            (b"k1", _avro(4, 1)),  # below k1's 2: an order violation
            (b"k2", _avro(3, 1)),  # the same event id again: a duplicate
            (b"k2", b"\0\0\0\0\7garbage"),
            (b"k3", json.dumps({"g": 9, "s": 1, "p": ""}).encode()),
        ]
    ):
        event_id = b"dup" if i in (2, 4) else str(i).encode()
        tally.add(key, value, [(_HEADER, event_id)], 1000 + i)
    got = tally.summary(6)
    assert got["unique"] == 6
    assert got["duplicates"] == 1
    assert got["complete"]
    assert got["keys"] == 3
    assert got["order_violations"] == 1
    assert got["keyed_without_seq"] == 1
    assert got["avro_records"] == 5  # the garbage one is framed too; JSON is not


def _cell(mode: str, rate: float, rnd: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "cell": 1,
        "round": rnd,
        "mix": "keys-1000",
        "mode": mode,
        "rows": 10,
        "unique": 10,
        "timed_out": False,
        "rate_first_last": rate,
        **extra,
    }


def test_issue_33_target_and_json_records_of_an_avro_mode() -> None:
    result: dict[str, Any] = {
        "config": {"modes": ["relay-1", "relay-1-avro"], "mixes": ["keys-1000"]},
        "cells": [_cell("relay-1", 10_000.0), _cell("relay-1-avro", 7_000.0, avro_records=10)],
    }
    (target,) = summarize(result)["targets"]
    assert target["target"] == "relay-1-avro vs relay-1, keys-1000: >= 0.8x its JSON rate"
    assert target["ratio"] == pytest.approx(0.7)
    assert target["verdict"] == "MISSED"
    assert problems(result) == []
    result["cells"][1]["avro_records"] = 0
    assert problems(result) == [
        "cell 1 (keys-1000, relay-1-avro, round 1): 0 of 10 events Avro-encoded"
    ]

"""OpenTelemetry (the [otel] extra): the trace context of ``enqueue``, the relay's producer
spans, and a library that works without it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from notify_outbox.core.outbox import OutboxRow
from notify_outbox.core.tracing import record_send_spans, with_trace_context
from notify_outbox.kafka.publisher import PublishResult
from notify_outbox.producer.enqueue import OutboxEvent, prepare_events
from tests.support import ROOT


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _traceparent(span: object) -> str:
    ctx = span.get_span_context()  # type: ignore[attr-defined]
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def test_enqueued_events_carry_the_active_spans_traceparent(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = spans
    with provider.get_tracer("app").start_as_current_span("place order") as span:
        (plain, with_headers, own) = prepare_events(
            [
                OutboxEvent(topic="orders", payload=1),
                OutboxEvent(topic="orders", payload=2, headers={"a": "b"}),
                OutboxEvent(topic="orders", payload=3, headers={"traceparent": "mine"}),
            ]
        )
    assert json.loads(plain.headers_json or "") == {"traceparent": _traceparent(span)}
    assert json.loads(with_headers.headers_json or "") == {
        "a": "b",
        "traceparent": _traceparent(span),
    }
    assert json.loads(own.headers_json or "") == {"traceparent": "mine"}  # the caller's wins


def test_no_active_span_no_header() -> None:
    (event,) = prepare_events([OutboxEvent(topic="orders", payload=1)])
    assert event.headers_json is None
    assert with_trace_context({"a": "b"}) == {"a": "b"}
    assert with_trace_context("not a mapping") == "not a mapping"


def _row(n: int, headers: dict[str, str] | None, key: str | None = "k") -> OutboxRow:
    return OutboxRow(
        id=n,
        event_id=uuid.uuid4(),
        topic="orders",
        key=key,
        payload="{}",
        payload_bytes=None,
        headers=None if headers is None else json.dumps(headers),
        attempts=2,
    )


def test_send_spans_are_producer_spans_linked_to_each_rows_traceparent(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("a") as a:
        pass
    with tracer.start_as_current_span("b") as b:
        pass
    rows = [
        _row(1, {"traceparent": _traceparent(a), "x": "y"}),
        _row(2, None),  # untraced: no span
        _row(3, {"traceparent": _traceparent(b)}, key=None),
        _row(4, {"traceparent": _traceparent(b)}, key="held"),  # not sent: no span
    ]
    exporter.clear()
    result = PublishResult(delivered=[1], failed=[(3, "topic 'orders' does not exist")])
    record_send_spans(rows, result, 1_000, tracer=provider.get_tracer("notify_outbox"))
    done = {s.attributes["notify_outbox.row_id"]: s for s in exporter.get_finished_spans()}
    assert set(done) == {1, 3}
    one, three = done[1], done[3]
    assert one.name == "send orders"
    assert one.kind is SpanKind.PRODUCER
    assert one.parent is None
    assert [link.context.span_id for link in one.links] == [a.get_span_context().span_id]
    assert [link.context.trace_id for link in three.links] == [b.get_span_context().trace_id]
    assert one.status.status_code is StatusCode.OK
    assert three.status.status_code is StatusCode.ERROR
    assert "does not exist" in (three.status.description or "")
    assert one.attributes["messaging.system"] == "kafka"
    assert one.attributes["messaging.destination.name"] == "orders"
    assert one.attributes["messaging.message.id"] == str(rows[0].event_id)
    assert one.attributes["messaging.kafka.message.key"] == "k"
    assert "messaging.kafka.message.key" not in three.attributes
    assert one.attributes["notify_outbox.attempt"] == 3
    assert one.start_time == 1_000
    assert one.end_time is not None
    assert one.end_time > one.start_time


def test_kafka_going_away_marks_the_unsent_rows_spans_as_errors(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    with provider.get_tracer("app").start_as_current_span("a") as a:
        pass
    exporter.clear()
    rows = [_row(1, {"traceparent": _traceparent(a)})]
    record_send_spans(
        rows,
        PublishResult(unavailable="Kafka stopped answering"),
        0,
        tracer=provider.get_tracer("x"),
    )
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "Kafka unavailable: Kafka stopped answering"


def test_the_library_works_without_opentelemetry() -> None:
    """The [otel] extra is optional: with its import failing, enqueue and the relay's
    publisher import and run, and add no header."""
    code = """
import sys
sys.modules["opentelemetry"] = None  # makes every `import opentelemetry...` fail
import notify_outbox
from notify_outbox.core import tracing
from notify_outbox.producer.enqueue import OutboxEvent, prepare_events
from notify_outbox.kafka.publisher import PublishResult
assert not tracing.AVAILABLE
(e,) = prepare_events([OutboxEvent(topic="t", payload=1, headers={"a": "b"})])
assert e.headers_json == '{"a": "b"}', e.headers_json
tracing.record_send_spans([], PublishResult(), 0)
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"

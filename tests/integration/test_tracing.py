"""OpenTelemetry end to end: `enqueue` inside a span writes its traceparent into the row, the
relay carries it to Kafka and records a producer span linked to it."""

from __future__ import annotations

import anyio
import asyncpg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from notify_outbox import OutboxSettings, Relay, enqueue
from tests.conftest import Services
from tests.support import consume, header

pytestmark = pytest.mark.anyio

_EXPORTER = InMemorySpanExporter()


def _global_exporter() -> InMemorySpanExporter:
    """The process-wide tracer provider can be set once: set it (an SDK provider exporting
    to memory) the first time, reuse it after."""
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    return _EXPORTER


async def test_a_traced_enqueue_reaches_kafka_with_its_traceparent_and_a_linked_send_span(
    db_dsn: str, services: Services, topic: str
) -> None:
    exporter = _global_exporter()
    tracer = trace.get_tracer("the-app")
    settings = OutboxSettings(
        dsn=db_dsn, kafka_bootstrap_servers=services.bootstrap, workers=1, poll_interval=30
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        async with Relay(settings) as relay:
            with tracer.start_as_current_span("place order") as span:
                async with conn.transaction():
                    event_id = await enqueue(
                        conn, topic=topic, key="order-42", payload={"total": 10}
                    )
            await enqueue(conn, topic=topic, key="order-43", payload={"total": 11})  # no span
            records, _ = await consume(services.bootstrap, topic, expect=2, within=30)
            with anyio.fail_after(30):
                await relay.events.wait_for("published", 2)
    finally:
        await conn.close()
    ctx = span.get_span_context()
    traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    traced = next(r for r in records if r.key == b"order-42")
    untraced = next(r for r in records if r.key == b"order-43")
    assert header(traced, "traceparent") == traceparent
    assert header(traced, "outbox-event-id") == str(event_id)
    assert header(untraced, "traceparent") is None

    sends = [s for s in exporter.get_finished_spans() if s.name == f"send {topic}"]
    assert len(sends) == 1, "one span per traced row, none for the untraced one"
    (send,) = sends
    assert send.kind is SpanKind.PRODUCER
    assert send.status.status_code is StatusCode.OK
    assert [(link.context.trace_id, link.context.span_id) for link in send.links] == [
        (ctx.trace_id, ctx.span_id)
    ]
    assert send.attributes is not None
    assert send.attributes["messaging.message.id"] == str(event_id)
    assert send.attributes["messaging.kafka.message.key"] == "order-42"

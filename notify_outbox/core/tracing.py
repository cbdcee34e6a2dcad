"""OpenTelemetry, when installed (``pip install 'notify-outbox[otel]'``): the W3C trace context
goes from ``enqueue`` to Kafka, and the relay records a producer span for each traced row.

- ``enqueue`` / ``enqueue_many`` write the ``traceparent`` (and ``tracestate``) of the current
  OpenTelemetry context into the row's headers, when a span is active and the event does not
  carry a ``traceparent`` of its own. Plain-SQL producers can write the header themselves.
- The relay sends headers as they are, so the Kafka record carries that ``traceparent``; a
  consumer continues the producer's trace from it.
- For each row with a ``traceparent`` that the relay sent (or tried to), it records a span
  ``send <topic>`` of kind PRODUCER, *linked* to the producer's span context (a relay batch
  mixes many traces; a link, not a parent, is how OpenTelemetry's messaging conventions tie a
  batch's send to each message's creation). It lasts from the batch's start to its acks.

Without OpenTelemetry installed, or without a configured SDK, all of this costs a dict lookup:
the API's default tracer records nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .message import PublishResult
    from .outbox import OutboxRow

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the [otel] extra is not installed: tracing is off
    trace = None  # type: ignore[assignment]

__all__ = ["AVAILABLE", "record_send_spans", "with_trace_context"]

#: Whether the OpenTelemetry API can be imported.
AVAILABLE = trace is not None
_TRACE_HEADERS = ("traceparent", "tracestate")
_propagator = TraceContextTextMapPropagator() if trace is not None else None


def with_trace_context(headers: Any) -> Any:
    """``headers`` plus the ``traceparent`` / ``tracestate`` of the active span, if any (as a
    new dict). Headers that already hold a ``traceparent``, or that are not a mapping (the
    caller's validation reports those), come back unchanged."""
    if _propagator is None or not (headers is None or isinstance(headers, Mapping)):
        return headers
    if headers is not None and "traceparent" in headers:
        return headers
    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    if "traceparent" not in carrier:
        return headers
    return {**(headers or {}), **carrier}


def _trace_headers(row: OutboxRow) -> dict[str, str] | None:
    # A cheap test first: most rows carry no trace context.
    if row.headers is None or "traceparent" not in row.headers:
        return None
    try:
        parsed = json.loads(row.headers)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("traceparent"), str):
        return None
    return {k: v for k in _TRACE_HEADERS if isinstance(v := parsed.get(k), str)}


def record_send_spans(
    rows: Sequence[OutboxRow], result: PublishResult, started_ns: int, *, tracer: Any = None
) -> None:
    """Record a PRODUCER span per traced row of a published batch, linked to the row's
    ``traceparent``: OK when Kafka acknowledged it, ERROR (with the reason) when it failed or
    Kafka became unavailable. Rows held back without a send get no span. ``tracer``: for
    tests; default the global tracer provider's."""
    if _propagator is None:
        return
    # Most rows carry no trace context: find the few that do before building anything.
    traced = [row for row in rows if row.headers is not None and "traceparent" in row.headers]
    if not traced:
        return
    delivered = set(result.delivered)
    reasons = dict(result.failed) | dict(result.rejected)
    ended = time.time_ns()
    for row in traced:
        carrier = _trace_headers(row)
        if carrier is None:
            continue
        if row.id in delivered:
            error = None
        elif row.id in reasons:
            error = reasons[row.id]
        elif result.unavailable is not None:
            error = f"{result.dependency} unavailable: {result.unavailable}"
        else:
            continue  # held back behind an earlier row of its key: not sent
        linked = trace.get_current_span(_propagator.extract(carrier)).get_span_context()
        use = tracer if tracer is not None else trace.get_tracer("notify_outbox")
        span = use.start_span(
            f"send {row.topic}",
            context=Context(),  # a root span: its link, not a parent, names the producer
            kind=trace.SpanKind.PRODUCER,
            links=[trace.Link(linked)] if linked.is_valid else [],
            start_time=started_ns,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.name": "send",
                "messaging.operation.type": "send",
                "messaging.destination.name": row.topic,
                "messaging.message.id": str(row.event_id),
                **({"messaging.kafka.message.key": row.key} if row.key is not None else {}),
                "notify_outbox.row_id": row.id,
                "notify_outbox.attempt": row.attempts + 1,
            },
        )
        if error is None:
            span.set_status(trace.Status(trace.StatusCode.OK))
        else:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end(end_time=ended)

"""The Debezium mode: the capture that feeds Debezium's outbox EventRouter from the outbox table.

The public names of the former ``notify_outbox.debezium`` module, which lives on as this package.
"""

from .capture import (
    DEFAULT_OPTIONS,
    CaptureReport,
    DebeziumCapture,
    HeaderField,
    debezium_headers,
    install_capture,
    parse_connector_config,
    render_capture,
    verify_capture,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "CaptureReport",
    "DebeziumCapture",
    "HeaderField",
    "debezium_headers",
    "install_capture",
    "parse_connector_config",
    "render_capture",
    "verify_capture",
]

"""The core every other part builds on: errors, settings, names, durations, backoff, logs,
the relay's events and tracing, and the message and row types.

Nothing here imports another part of notify-outbox (tests/unit/test_layers.py).
"""

"""Worked examples of notify-outbox (run from the repository root)."""

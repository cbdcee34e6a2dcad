"""notify-outbox's latency and throughput bench: the NOTIFY relay vs plain polling, side by
side. ``python -m bench --help``; see ``bench/README.md``."""

"""notify-outbox's latency and throughput bench: the NOTIFY relay vs plain polling, side by side.

``python -m bench run`` (see ``bench/README.md``), ``python -m bench smoke``,
``python -m bench drain`` (backlog drain), ``python -m bench recovery`` (outage recovery),
``python -m bench report FILE.json``.
"""

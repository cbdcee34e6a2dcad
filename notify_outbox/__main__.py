"""``python -m notify_outbox``: the command-line interface."""

from .cli import main

raise SystemExit(main())

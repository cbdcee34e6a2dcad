"""``python -m notify_outbox``: the command-line interface."""

from .cli.main import main

raise SystemExit(main())

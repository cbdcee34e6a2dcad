"""The command line: ``notify-outbox`` and its subcommands, a thin shell over the library.

``app.py`` holds the entry point (``notify_outbox.cli:main``); ``admin.py``, ``inbox.py`` and
``debezium.py`` hold their subcommands.
"""

from .app import main, tune_gc

__all__ = ["main", "tune_gc"]

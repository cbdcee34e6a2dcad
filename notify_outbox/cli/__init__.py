"""The command line: ``notify-outbox`` and its subcommands, a thin shell over the library.

``main.py`` is the entry point (``notify_outbox.cli:main``); ``admin.py``, ``inbox.py`` and
``debezium.py`` hold their subcommands.
"""

from .main import main, tune_gc

__all__ = ["main", "tune_gc"]

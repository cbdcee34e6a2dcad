"""`run`'s signal handling where the event loop cannot watch signals (Windows)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import pytest

from notify_outbox.cli.app import _install_signal_handlers

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def test_without_loop_signal_handlers_signal_signal_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.new_event_loop()

    def refuse(*_args: object) -> None:
        raise NotImplementedError  # what the Windows event loops do

    monkeypatch.setattr(loop, "add_signal_handler", refuse)
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    seen: list[int] = []
    try:
        uninstall = _install_signal_handlers(loop, seen.append)
        try:
            for sig in SIGNALS:
                handler = signal.getsignal(sig)
                assert callable(handler)
                assert handler is not before[sig]
            # Only raised once our handler is known to be there (the default would end pytest).
            signal.raise_signal(signal.SIGTERM)
            loop.run_until_complete(asyncio.sleep(0.05))
        finally:
            uninstall()
        assert seen == [signal.SIGTERM]
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
    finally:
        loop.close()


def test_loop_signal_handlers_are_used_where_they_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.new_event_loop()
    added: list[int] = []
    add = loop.add_signal_handler

    def spy(sig: int, callback: Callable[..., object], *args: object) -> None:
        added.append(sig)
        add(sig, callback, *args)

    monkeypatch.setattr(loop, "add_signal_handler", spy)
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        uninstall = _install_signal_handlers(loop, lambda _sig: None)
        assert added == list(SIGNALS)
        uninstall()
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
    finally:
        loop.close()

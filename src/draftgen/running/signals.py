"""Graceful-stop signal handlers for a run's dispatch phase, and putting back what was there."""

from __future__ import annotations

import asyncio
import signal
from typing import Any


def install_signals(loop: asyncio.AbstractEventLoop, handler: Any) -> list[tuple[int, Any]]:
    """Graceful-stop handlers for the dispatch phase; returns what to restore after it."""
    installed: list[tuple[int, Any]] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        try:
            loop.add_signal_handler(sig, handler, sig)
            installed.append((sig, previous))
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    return installed


def restore_signals(loop: asyncio.AbstractEventLoop, installed: list[tuple[int, Any]]) -> None:
    for sig, previous in installed:
        loop.remove_signal_handler(sig)
        signal.signal(sig, previous)

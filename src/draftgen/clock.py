"""Time as a dependency: code that waits or measures takes a `Clock`.

Backoff, ETA and watchdog logic then runs in tests on `FakeClock`, whose `sleep` moves
time forward at once instead of waiting.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; for durations."""
        ...

    def time(self) -> float:
        """Seconds since the Unix epoch; for timestamps that are written down."""
        ...

    async def sleep(self, s: float) -> None: ...


class RealClock:
    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, s: float) -> None:
        await asyncio.sleep(s)


REAL_CLOCK: Clock = RealClock()


class FakeClock:
    """A clock that moves only when told to, or when something sleeps on it.

    `sleep(s)` adds `s` to the time at once and yields to the event loop once, so
    other tasks still get to run. Each sleeper adds its own delay: with several tasks
    sleeping concurrently time runs ahead of a real clock; use `advance` when a test
    needs a precise timeline.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now

    def advance(self, s: float) -> None:
        if s < 0:
            raise ValueError(f"cannot move a clock back ({s}s)")
        self._now += s

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self._now += max(0.0, s)
        await asyncio.sleep(0)


def format_duration(s: float | None) -> str:
    """A duration for people: 1d01h, 1h01m, 4m05s, 5.4s; "?" when unknown."""
    if s is None:
        return "?"
    if s < 60:
        return f"{s:.1f}s"
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"

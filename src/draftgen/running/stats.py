"""Run counters and sliding windows; views only ever see frozen snapshots of them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from draftgen.clock import Clock
from draftgen.running.eta import RATE_WINDOW_S
from draftgen.sample import Failure, Record


@dataclass(frozen=True, slots=True)
class CategorySnapshot:
    name: str
    planned: int
    done: int
    failed: int
    truncated: int
    in_flight: int
    output_tokens: int

    @property
    def pending(self) -> int:
        return self.planned - self.done - self.failed


@dataclass(frozen=True, slots=True)
class ServerSnapshot:
    """One server as the run sees it: state, the server's own load, the scheduler's target."""

    url: str
    up: bool
    in_flight: int
    capacity: int | None = None
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    target: float | None = None
    # Why the last load poll got no answer (the load fields are then unknown, not stale).
    load_error: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    elapsed_s: float
    categories: tuple[CategorySnapshot, ...]
    in_flight: int
    sent: int
    retries: int
    tok_s_window: float
    tok_s_overall: float
    eta_s: float | None
    note: str = ""
    servers: tuple[ServerSnapshot, ...] = ()

    def total(self, attr: str) -> int:
        return sum(int(getattr(c, attr)) for c in self.categories)


@dataclass(slots=True)
class _Counts:
    planned: int = 0
    done: int = 0
    failed: int = 0
    truncated: int = 0
    in_flight: int = 0
    # Output tokens of every sample done in this category, earlier runs included.
    done_tokens: int = 0


@dataclass(slots=True)
class _Window:
    """Streamed tokens per second bucket over the last `span_s` seconds."""

    span_s: int = 60
    buckets: deque[tuple[int, int]] = field(default_factory=deque)

    def add(self, second: int, n: int) -> None:
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1] = (second, self.buckets[-1][1] + n)
        else:
            self.buckets.append((second, n))
        while self.buckets and self.buckets[0][0] <= second - self.span_s:
            self.buckets.popleft()

    def rate(self, now: float, started: float) -> float:
        while self.buckets and self.buckets[0][0] <= int(now) - self.span_s:
            self.buckets.popleft()
        span = min(float(self.span_s), now - started)
        return sum(n for _, n in self.buckets) / span if span > 0 else 0.0


class RunStats:
    """Counts one run. Methods are called from request tasks on the event loop thread."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._started = clock.monotonic()
        self._cats: dict[str, _Counts] = {}
        self._window = _Window()
        self._recent = _Window(span_s=RATE_WINDOW_S)
        self._streamed = 0
        self.sent = 0
        self.retries = 0
        self.note = ""
        # The servers as the monitor sees them now (it sets this).
        self.server_view: Callable[[], tuple[ServerSnapshot, ...]] = tuple
        # Seconds the run has left (the dispatcher sets it: running/eta.py); None: unknown.
        self.eta_view: Callable[[], float | None] = lambda: None

    def plan(self, category: str, *, planned: int) -> None:
        self._cats.setdefault(category, _Counts()).planned += planned

    def already(self, category: str, *, done: int, failed: int, truncated: int,
                output_tokens: int) -> None:
        """Outcomes recorded by earlier runs: they count as done but not toward speed."""
        c = self._cats.setdefault(category, _Counts())
        c.done += done
        c.failed += failed
        c.truncated += truncated
        c.done_tokens += output_tokens

    def started(self, category: str) -> None:
        self._cats[category].in_flight += 1
        self.sent += 1

    def token(self, n: int = 1) -> None:
        self._streamed += n
        second = int(self._clock.monotonic())
        self._window.add(second, n)
        self._recent.add(second, n)

    def recent_rate(self) -> float:
        """Tokens a second streamed over the last RATE_WINDOW_S seconds (the ETA's pace)."""
        return self._recent.rate(self._clock.monotonic(), self._started)

    def retried(self) -> None:
        self.retries += 1

    def cancelled(self, category: str) -> None:
        self._cats[category].in_flight -= 1

    def finished(self, outcome: Record | Failure) -> None:
        c = self._cats[outcome.category]
        c.in_flight -= 1
        if isinstance(outcome, Record):
            c.done += 1
            c.truncated += outcome.truncated
            c.done_tokens += outcome.output_tokens
        else:
            c.failed += 1

    def snapshot(self) -> Snapshot:
        now = self._clock.monotonic()
        elapsed = now - self._started
        window = self._window.rate(now, self._started)
        overall = self._streamed / elapsed if elapsed > 0 else 0.0
        eta = self.eta_view()
        cats = tuple(
            CategorySnapshot(name, c.planned, c.done, c.failed, c.truncated, c.in_flight,
                             c.done_tokens)
            for name, c in self._cats.items()
        )
        return Snapshot(elapsed, cats, sum(c.in_flight for c in cats), self.sent, self.retries,
                        window, overall, eta, self.note, self.server_view())

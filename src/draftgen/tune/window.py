"""What the job's own requests get from a server: a short window of them, measured.

The job's samples (its prompts, system prompts, sampling and each partition's max_tokens)
are sent as the job would send them, each partition keeping its own `concurrency` in
flight, round-robin over categories so a short window sees every kind of prompt. Only the
per-sample seed is left out: it changes no speed, and vLLM's CPU build crashes on seeded
requests that are preempted or prefilled in chunks. After `warmup_s`, the output tokens
streamed during `seconds` give the window's tok/s; every request's decode interval within
those seconds (from its first token or the warmup's end, whichever is later, to its end or
the window's end, with the tokens it streamed in that time) gives decode speed against
batch size for the capacity model (`planning.measured.speed_from_intervals`), finished
answers their lengths, and the requests still running at the end (`unfinished`) how many
answers outlasted the window. The warmup is left out of the speeds: its opening burst (one
request decoding while the rest prefill) is no decode speed the job will see. Where `load` reads
the server's load (`client.load.LoadPoller.poll`), the window also keeps what bound it:
the peak KV usage, the most requests running and waiting, and the preemptions — whether a
lever on KV memory or the running limit can pay.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from draftgen.client import ChatClient
from draftgen.clock import REAL_CLOCK, Clock
from draftgen.engines.load import ServerLoad
from draftgen.errors import RequestError, RunError
from draftgen.planning.measured import speed_from_intervals
from draftgen.planning.workload import DecodeSpeed
from draftgen.sample import Sample, request_body

LOAD_EVERY_S = 0.5


@dataclass
class Window:
    """What one window measured."""

    tok_s: float = 0.0
    completed: int = 0
    failed: int = 0
    lengths: dict[str, list[int]] = field(default_factory=dict)  # "category/partition"
    # Requests still running when the measured seconds ended: answers longer than the
    # window, which its lengths do not hold ("category/partition").
    unfinished: dict[str, int] = field(default_factory=dict)
    intervals: list[tuple[float, float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    streamed: int = 0  # output tokens streamed so far, all requests
    # What the server's load readings showed during the measured seconds (None: unread).
    kv_peak: float | None = None
    running_peak: int | None = None
    waiting_peak: int | None = None
    preempted: int | None = None

    def saw(self, load: ServerLoad, first: ServerLoad) -> None:
        """One reading; `first` is the window's first, from which preemptions count."""
        if load.kv_usage is not None:
            self.kv_peak = max(self.kv_peak or 0.0, load.kv_usage)
        if load.running is not None:
            self.running_peak = max(self.running_peak or 0, load.running)
        if load.waiting is not None:
            self.waiting_peak = max(self.waiting_peak or 0, load.waiting)
        if None not in (load.preemptions_total, first.preemptions_total):
            self.preempted = (load.preemptions_total or 0) - (first.preemptions_total or 0)

    def speed(self) -> DecodeSpeed | None:
        return speed_from_intervals({"server": self.intervals})


def interleaved(samples: Sequence[Sample]) -> list[Sample]:
    """Plan order, taken in turn from each category: the first few cover every kind."""
    by_cat: dict[str, list[Sample]] = {}
    for s in samples:
        by_cat.setdefault(s.category, []).append(s)
    columns = list(by_cat.values())
    return [col[i] for i in range(max(map(len, columns), default=0))
            for col in columns if i < len(col)]


def group_key(sample: Sample) -> str:
    return f"{sample.category}/{sample.partition}"


async def measure_window(url: str, samples: Sequence[Sample], base: Mapping[str, Any],
                         concurrency: Mapping[str, int], *, seconds: float, warmup_s: float,
                         api_key: str | None = None, clock: Clock = REAL_CLOCK,
                         load: Callable[[], Awaitable[ServerLoad | None]] | None = None
                         ) -> Window:
    """Send the job's samples to `url` for `warmup_s + seconds` (see the module docstring).

    A run-level error (refused key, unknown model) is raised; a failed request is counted.
    """
    window = Window()
    by_part: dict[str, list[Sample]] = {}
    for s in interleaved(samples):
        by_part.setdefault(s.partition, []).append(s)
    t_start = clock.monotonic()
    t_measured = t_start + warmup_s
    t_end = t_measured + seconds
    in_flight: dict[str, int] = {}

    async def worker(feed: Iterator[Sample], client: ChatClient) -> None:
        for sample in feed:
            body = request_body(sample, base, list(sample.messages))
            body.pop("seed", None)
            stream = _Stream(window, clock, t_measured)
            group = group_key(sample)
            in_flight[group] = in_flight.get(group, 0) + 1
            try:
                done = await client.chat(url, body, on_token=stream.on_token)
            except RunError:
                raise
            except RequestError as e:
                window.failed += 1
                if len(window.errors) < 3:
                    window.errors.append(str(e)[:200])
                continue
            finally:
                in_flight[group] -= 1
                stream.close(min(clock.monotonic(), t_end))
            if clock.monotonic() <= t_end:
                window.completed += 1
                tokens = done.completion_tokens or stream.tokens
                window.lengths.setdefault(group, []).append(tokens)

    async with ChatClient(api_key=api_key, idle_timeout_s=max(60.0, 4 * seconds)) as client:
        tasks = []
        for part, items in by_part.items():
            if not items:
                continue
            # Each worker takes the next sample of its partition, cycling if the window
            # outlasts the plan.
            feed = _shared(itertools.cycle(items))
            tasks += [asyncio.create_task(worker(feed, client))
                      for _ in range(max(1, concurrency.get(part, 1)))]
        try:
            await clock.sleep(warmup_s)
            before = window.streamed
            if load is not None:
                tasks.append(asyncio.create_task(_watch(window, load, clock)))
            await clock.sleep(seconds)
            window.tok_s = (window.streamed - before) / seconds if seconds > 0 else 0.0
            window.unfinished = {g: n for g, n in in_flight.items() if n > 0}
            for t in tasks:
                error = t.exception() if t.done() and not t.cancelled() else None
                if error is not None:
                    raise error
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)
    return window


class _Stream:
    """One request's tokens as they stream, and its decode interval once it ends."""

    def __init__(self, window: Window, clock: Clock, measured_from: float) -> None:
        self.window = window
        self.clock = clock
        self.measured_from = measured_from
        self.first: float | None = None
        self.tokens = 0
        self.before = 0  # tokens streamed before the measured seconds began

    def on_token(self, written: int) -> None:
        now = self.clock.monotonic()
        if self.first is None:
            self.first = now
        if now < self.measured_from:
            self.before = written
        self.window.streamed += written - self.tokens
        self.tokens = written

    def close(self, end: float) -> None:
        if self.first is None:
            return
        start = max(self.first, self.measured_from)
        tokens = self.tokens - (self.before if self.first < self.measured_from else 0)
        if tokens > 1 and end > start:
            self.window.intervals.append((start, end, tokens))


async def _watch(window: Window, load: Callable[[], Awaitable[ServerLoad | None]],
                 clock: Clock) -> None:
    """The server's load every LOAD_EVERY_S until cancelled (a missed reading is skipped)."""
    first: ServerLoad | None = None
    while True:
        reading = await load()
        if reading is not None:
            first = first or reading
            window.saw(reading, first)
        await clock.sleep(LOAD_EVERY_S)


def _shared(source: Iterator[Sample]) -> Iterator[Sample]:
    """One iterator many workers pull from (asyncio runs them one at a time)."""
    yield from source

"""Capacity-aware admission: keep the expected KV footprint in flight just under capacity.

Each request is expected to hold `prompt + expected output` KV tokens at its end, with the
expected output learned online per category from finished samples. A server takes a new
request while the sum over its in-flight requests stays under its target, `factor ×
capacity`. The factor corrects itself from what the server reports (`ServerLoad`): it backs
off on preemptions/retractions or a growing server queue, and pushes up while the client is
the limit (its budget is full) yet the server's queue is dry and KV usage is below target.
A short queue at the server is welcome: it refills a slot the moment one frees.

Partitions compete for the budget by deficit: the one whose share of in-flight tokens lags
its share of remaining work goes first, so long requests start all along the run instead of
piling up into a long tail at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from draftgen.sample import Sample
from draftgen.schedule.base import PartitionView, Scheduler
from draftgen.schedule.load import ServerLoad
from draftgen.serverpool import ServerState

FACTOR_MIN = 0.25
FACTOR_MAX = 8.0
BACK_OFF_PREEMPT = 0.8
BACK_OFF_QUEUE = 0.95
PUSH_UP = 1.05
KV_TARGET = 0.85
QUEUE_OK = 2  # waiting requests at the server that count as "a short queue"
# Readings after a back-off before the target may rise again: a preemption burst shows
# over several readings, and pushing straight back up would oscillate.
COOL_DOWN = 5


@dataclass(slots=True)
class _ServerControl:
    capacity: int | None = None
    factor: float = 1.0
    preemptions: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    running: int | None = None
    block: int = 1  # KV allocation granularity in tokens
    calm: int = COOL_DOWN  # readings since the last back-off

    @property
    def target(self) -> float | None:
        return None if self.capacity is None else self.capacity * self.factor


class AdaptiveScheduler(Scheduler):
    name = "adaptive"

    def __init__(self, log: Callable[[str], None] | None = None, *,
                 initial_factor: float = 1.0) -> None:
        super().__init__(log)
        self._control: dict[str, _ServerControl] = {}
        self._initial_factor = initial_factor
        self._partition_tokens: dict[str, float] = {}

    def control(self, url: str) -> _ServerControl:
        c = self._control.get(url)
        if c is None:
            c = self._control[url] = _ServerControl(factor=self._initial_factor)
        return c

    def footprint_on(self, sample: Sample, url: str) -> float:
        """The footprint in whole KV blocks of that server: a 130-token answer holds two
        128-token blocks, which for short answers nearly doubles what it occupies."""
        block = self.control(url).block
        return -(-self.footprint(sample) // block) * block

    def started(self, sample: Sample, server: ServerState) -> None:
        size = self.footprint_on(sample, server.url)
        self.books.footprints[sample.id] = size
        self.books.in_flight_tokens[server.url] = (
            self.books.in_flight_tokens.get(server.url, 0.0) + size)
        self._partition_tokens[sample.partition] = (
            self._partition_tokens.get(sample.partition, 0.0) + size)

    def ended(self, sample: Sample, server: ServerState, output_tokens: int | None) -> None:
        size = self.books.footprints.get(sample.id, 0.0)
        self._partition_tokens[sample.partition] = max(
            0.0, self._partition_tokens.get(sample.partition, 0.0) - size)
        super().ended(sample, server, output_tokens)

    def on_load(self, server: ServerState, load: ServerLoad) -> None:
        c = self.control(server.url)
        if load.kv_block_tokens:
            c.block = load.kv_block_tokens
        if load.kv_capacity_tokens and load.kv_capacity_tokens != c.capacity:
            self._log(f"{server.url}: capacity {load.kv_capacity_tokens:,} KV tokens")
            c.capacity = load.kv_capacity_tokens
        new_preempt = 0
        if load.preemptions_total is not None:
            if c.preemptions is not None:
                new_preempt = max(0, load.preemptions_total - c.preemptions)
            c.preemptions = load.preemptions_total
        growing = (load.waiting is not None and c.waiting is not None
                   and load.waiting > QUEUE_OK and load.waiting > c.waiting)
        c.waiting, c.kv_usage, c.running = load.waiting, load.kv_usage, load.running
        if c.capacity is None:
            return
        target = c.capacity * c.factor
        budget_full = self.books.in_flight_tokens.get(server.url, 0.0) >= 0.9 * target
        c.calm += 1
        if new_preempt:
            # One back-off per burst: the readings right after it still show the same burst.
            if c.calm > 1:
                self._set(server.url, c, c.factor * BACK_OFF_PREEMPT,
                          f"{new_preempt} preemption(s)/retraction(s) since the last reading")
            c.calm = 0
        elif growing:
            self._set(server.url, c, c.factor * BACK_OFF_QUEUE,
                      f"server queue growing: {load.waiting} waiting")
            c.calm = 0
        elif (c.calm >= COOL_DOWN and budget_full and (load.waiting or 0) == 0
              and (load.kv_usage is None or load.kv_usage < KV_TARGET)):
            usage = "unknown" if load.kv_usage is None else f"{load.kv_usage:.0%}"
            self._set(server.url, c, c.factor * PUSH_UP,
                      f"budget full but server queue dry and KV usage {usage} < {KV_TARGET:.0%}")

    def _set(self, url: str, c: _ServerControl, factor: float, reason: str) -> None:
        factor = min(FACTOR_MAX, max(FACTOR_MIN, factor))
        if factor == c.factor:
            return
        before = c.target
        c.factor = factor
        assert before is not None and c.target is not None
        self._log(f"{url}: target {before:,.0f} → {c.target:,.0f} KV tokens "
                  f"(×{factor:.2f} of capacity): {reason}")

    def _free(self, server: ServerState) -> float:
        target = self.control(server.url).target
        if target is None:
            return float("inf")  # no capacity known: partition concurrency alone limits
        return target - self.books.in_flight_tokens.get(server.url, 0.0)

    def pick(self, partitions: Sequence[PartitionView],
             servers: Sequence[ServerState]) -> tuple[str, ServerState] | None:
        ups = [s for s in servers if s.up]
        ready = [p for p in partitions if p.head is not None and p.in_flight < p.concurrency]
        if not ups or not ready:
            return None
        server = max(ups, key=self._free)
        part = max(ready, key=self._deficit(ready))
        assert part.head is not None
        if self._free(server) >= self.footprint_on(part.head, server.url) or not server.in_flight:
            return part.name, server
        return None

    def _deficit(self, ready: Sequence[PartitionView]) -> Callable[[PartitionView], float]:
        remaining = {p.name: p.queued * self.footprint(p.head) for p in ready if p.head}
        total_remaining = sum(remaining.values()) or 1.0
        total_flight = sum(self._partition_tokens.get(p.name, 0.0) for p in ready) or 1.0

        def deficit(p: PartitionView) -> float:
            return (remaining.get(p.name, 0.0) / total_remaining
                    - self._partition_tokens.get(p.name, 0.0) / total_flight)

        return deficit

    def targets(self) -> Mapping[str, float]:
        return {url: c.target for url, c in self._control.items() if c.target is not None}

    def server_view(self, url: str) -> dict[str, float | int | None]:
        c = self.control(url)
        return {"capacity": c.capacity, "target": c.target, "kv_usage": c.kv_usage,
                "running": c.running, "waiting": c.waiting,
                "in_flight_tokens": self.books.in_flight_tokens.get(url, 0.0)}

"""What to send where: one loop asks the scheduler each time something changes.

The loop creates a request task only when the scheduler picks a partition's next sample
and an up server for it, so a run of 10^5 samples never holds more than the window of live
requests. It never busy-waits: with nothing to send it sleeps until a request ends or comes
back, a first token arrives, a load reading, a server comes up, or the run stops.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter, deque
from collections.abc import Iterable, Mapping

from draftgen.job import Partition
from draftgen.running.eta import PartitionWork, Stream, time_left
from draftgen.running.request import Requester
from draftgen.running.state import PartitionQueue, RunState
from draftgen.running.stats import RunStats
from draftgen.sample import Sample
from draftgen.schedule.base import PartitionView, Scheduler
from draftgen.schedule.pool import ServerPool


class Dispatcher:
    def __init__(self, samples: Iterable[Sample], partitions: Mapping[str, Partition], *,
                 scheduler: Scheduler, pool: ServerPool, stats: RunStats,
                 state: RunState) -> None:
        self._queues: dict[str, PartitionQueue] = {}
        for s in samples:
            self._queues.setdefault(s.partition, PartitionQueue(deque())).samples.append(s)
        self._partitions = partitions
        self._scheduler = scheduler
        self._pool = pool
        self._stats = stats
        self._state = state
        # Categories queued per partition, recounted when a queue's length changes.
        self._counted: dict[str, tuple[int, Counter[str]]] = {}
        stats.eta_view = self.time_left

    def waiting(self) -> int:
        """Samples not yet finished: queued or in flight."""
        return sum(len(q.samples) + q.in_flight for q in self._queues.values())

    def time_left(self) -> float | None:
        """Seconds until the last answer ends, by running/eta.py."""
        books = self._scheduler.books
        flights: dict[str, list[Stream]] = {}
        written: dict[str, list[int]] = {}  # the answers still running count as censored
        for f in books.flights.values():
            flights.setdefault(f.sample.partition, []).append(
                Stream(f.sample.category, f.earlier + f.written, f.written))
            written.setdefault(f.sample.category, []).append(f.earlier + f.written)
        books.lengths.running(written)
        work = [PartitionWork(self._partitions[name].max_tokens, self._queued(name, q),
                              flights.get(name, []))
                for name, q in self._queues.items()]
        return time_left(work, books.lengths, self._stats.recent_rate())

    def _queued(self, name: str, queue: PartitionQueue) -> Counter[str]:
        n, counts = self._counted.get(name, (-1, Counter()))
        if n != len(queue.samples):
            counts = Counter(s.category for s in queue.samples)
            self._counted[name] = (len(queue.samples), counts)
        return counts

    def views(self) -> list[PartitionView]:
        return [
            PartitionView(name, self._partitions[name].concurrency,
                          self._partitions[name].max_tokens, len(q.samples),
                          q.samples[0] if q.samples else None, q.in_flight)
            for name, q in self._queues.items()
        ]

    async def run(self, requester: Requester, tg: asyncio.TaskGroup) -> None:
        state = self._state
        while not state.stop.is_set():
            if not any(q.samples or q.in_flight for q in self._queues.values()):
                return
            state.wake.clear()
            picked = self._scheduler.pick(self.views(), self._pool.servers)
            if picked is None:
                await state.wake.wait()
                continue
            name, server = picked
            queue = self._queues[name]
            sample = queue.samples.popleft()
            queue.in_flight += 1
            self._pool.assign(server)
            flight = self._scheduler.started(sample, server)
            self._stats.started(sample.category)
            task = tg.create_task(requester.send(flight, server, queue), name=sample.id)
            state.tasks.add(task)
            state.by_sample[sample.id] = task
            server.tasks.add(task)
            task.add_done_callback(server.tasks.discard)
            task.add_done_callback(state.forget)
            task.add_done_callback(functools.partial(requester.settle, flight=flight,
                                                     server=server, queue=queue))

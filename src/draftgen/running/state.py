"""What dispatch and the request tasks share while a run sends: a partition queue's shape
(the dispatcher holds the queues), the tasks in flight, and the stop and wake-up signals."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from draftgen.sample import Sample


@dataclass(slots=True)
class PartitionQueue:
    samples: deque[Sample]
    in_flight: int = 0


@dataclass(slots=True)
class RunState:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Set whenever what the scheduler may decide changes: a request ends or comes back, a
    # first token, a load reading, a server up, a stop.
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stop_reason: str | None = None
    exit_code: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    requeue: set[asyncio.Task[None]] = field(default_factory=set)
    by_sample: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # in flight
    outages: Counter[str] = field(default_factory=Counter)

    def forget(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self.by_sample.get(task.get_name()) is task:  # not yet sent again
            del self.by_sample[task.get_name()]

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.exit_code = exit_code
        self.stop.set()
        self.wake.set()

    def cancel_in_flight(self, but: asyncio.Task[Any] | None = None) -> None:
        for t in list(self.tasks):
            if t is not but:
                t.cancel()

    def requeue_tasks(self, tasks: list[asyncio.Task[None]]) -> None:
        """Cancel these requests; each goes back to the front of its queue, uncharged."""
        for t in tasks:
            self.requeue.add(t)
            t.cancel()

    def recall(self, sample_ids: list[str]) -> None:
        """Call these samples' requests back from their server (see `requeue_tasks`)."""
        self.requeue_tasks([t for sid in sample_ids
                            if (t := self.by_sample.get(sid)) is not None and not t.done()])

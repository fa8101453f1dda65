"""The job's fixed per-partition concurrency; each request to the least busy up server."""

from __future__ import annotations

from collections.abc import Sequence

from draftgen.schedule.base import PartitionView, Scheduler
from draftgen.schedule.pool import ServerState


class StaticScheduler(Scheduler):
    name = "static"

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def pick(self, partitions: Sequence[PartitionView],
             servers: Sequence[ServerState]) -> tuple[str, ServerState] | None:
        ups = [s for s in servers if s.up]
        if not ups:
            return None
        n = len(partitions)
        # Round-robin over partitions so none starves the others while all have room.
        for i in range(n):
            p = partitions[(self._turn + i) % n]
            if p.head is not None and p.in_flight < p.concurrency:
                self._turn = (self._turn + i + 1) % n
                return p.name, min(ups, key=lambda s: s.in_flight)
        return None

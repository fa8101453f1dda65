"""The single writer: one task owns the shard and ledger files for the whole run.

Outcomes are queued by request tasks and committed in groups: records to the shard and
fsync, then their ledger lines and fsync. A write error stops the writer and is raised to
the runner as `DiskError`; everything committed before it stays valid.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson

from draftgen.errors import DiskError
from draftgen.sample import Failure, Record
from draftgen.store.atomic import disk_error
from draftgen.store.ledger import LedgerEntry
from draftgen.store.run_store import LEDGER, entry_for
from draftgen.store.shards import ShardWriter

Outcome = Record | Failure

_STOP = object()


def failure_entry(f: Failure) -> LedgerEntry:
    return LedgerEntry(
        id=f.id, fingerprint=f.fingerprint, status="failed", category=f.category,
        partition=f.partition,
        reason=f"{f.reason}: {f.message}"[:500], attempts=f.attempts, time=f.finished_at,
        server=f.server,
    )


class OutcomeWriter:
    """Use as `async with OutcomeWriter(out) as w: await w.put(outcome)`."""

    def __init__(self, out_dir: Path, *, max_batch: int = 512,
                 shard_max_bytes: int = 256 << 20) -> None:
        self._out = out_dir
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._max_batch = max_batch
        self._shards = ShardWriter(out_dir, max_bytes=shard_max_bytes)
        self._ledger = open(out_dir / LEDGER, "ab")
        self._task: asyncio.Task[None] | None = None
        self.error: DiskError | None = None
        self.failed = asyncio.Event()

    async def __aenter__(self) -> OutcomeWriter:
        self._task = asyncio.create_task(self._loop(), name="outcome-writer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def put(self, outcome: Outcome) -> None:
        # After a write error outcomes are dropped uncommitted: they stay pending on disk
        # and the next run makes them again.
        if self.error is None:
            await self._queue.put(outcome)

    async def close(self) -> None:
        """Commit everything queued, then close the files. Safe to call twice."""
        if self._task is not None:
            await self._queue.put(_STOP)
            # Shielded: a cancelled run still commits what finished before it was cancelled.
            await asyncio.shield(self._task)
            self._task = None
        try:
            self._shards.close()
            self._ledger.close()
        except OSError as e:
            # Closing flushes again; a torn tail left by it is cut at the next open.
            self.error = self.error or disk_error(self._out, e)
        if self.error is not None:
            raise self.error

    async def _loop(self) -> None:
        stopping = False
        while not stopping:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            outcomes = [o for o in batch if o is not _STOP]
            stopping = len(outcomes) != len(batch)
            if not outcomes or self.error is not None:
                continue
            try:
                await asyncio.to_thread(self._commit, outcomes)  # type: ignore[arg-type]
            except OSError as e:
                self.error = disk_error(self._out, e)
                self.failed.set()

    def _commit(self, outcomes: list[Outcome]) -> None:
        records = [o for o in outcomes if isinstance(o, Record)]
        spots = self._shards.append([orjson.dumps(r) + b"\n" for r in records]) if records else []
        entries = [entry_for(r, spot) for r, spot in zip(records, spots, strict=True)]
        entries += [failure_entry(o) for o in outcomes if isinstance(o, Failure)]
        self._ledger.write(b"".join(e.to_line() for e in entries))
        self._ledger.flush()
        os.fsync(self._ledger.fileno())

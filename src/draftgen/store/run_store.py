"""Opening a run directory: lock it, repair it, and tell what is left to do."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from draftgen.errors import JobChangedError, StoreError
from draftgen.quality.checks import check_turns
from draftgen.sample import Record, Rejected, Sample
from draftgen.store.atomic import disk_error, write_atomic
from draftgen.store.ledger import LedgerEntry, load_ledger
from draftgen.store.shards import scan_tail, shard_paths, truncate

LEDGER = "ledger.jsonl"
PLAN = "plan.jsonl"
REJECTED = "rejected.jsonl"
MANIFEST = "manifest.json"
LOCK = ".lock"


@dataclass(frozen=True, slots=True)
class Repair:
    """What opening the store had to fix after an unclean stop."""

    ledger_torn_bytes: int = 0
    ledger_corrupt_lines: int = 0
    shard_torn_bytes: int = 0
    adopted_records: int = 0

    @property
    def any(self) -> bool:
        return bool(
            self.ledger_torn_bytes
            or self.ledger_corrupt_lines
            or self.shard_torn_bytes
            or self.adopted_records
        )


def entry_for(record: Record | dict[str, Any], spot: tuple[str, int, int]) -> LedgerEntry:
    """The ledger line that points at a record stored at `spot`."""
    d = record if isinstance(record, dict) else None
    if d is None:
        assert isinstance(record, Record)
        return LedgerEntry(
            id=record.id, fingerprint=record.fingerprint, status="done",
            category=record.category, partition=record.partition,
            shard=spot[0], offset=spot[1], length=spot[2],
            output_tokens=record.output_tokens, finish=record.finish_reason,
            truncated=record.truncated, attempts=record.attempts, time=record.finished_at,
            flags=list(check_turns(record.turns)) or None, configuration=record.server_config,
            server=record.server,
        )
    turns = d.get("turns") or []
    return LedgerEntry(
        id=d["id"], fingerprint=d["fingerprint"], status="done", category=d["category"],
        partition=d["partition"], shard=spot[0], offset=spot[1], length=spot[2],
        output_tokens=sum(int(t.get("completion_tokens") or 0) for t in turns),
        finish=turns[-1].get("finish_reason") if turns else None,
        truncated=any(t.get("finish_reason") == "length" for t in turns),
        attempts=int(d.get("attempts") or 0), time=float(d.get("finished_at") or 0.0),
        flags=list(check_turns(turns)) or None, configuration=d.get("server_config"),
        server=d.get("server"),
    )


class RunStore:
    """An opened run directory. Only one process may hold it at a time."""

    def __init__(self, out_dir: Path, entries: dict[str, LedgerEntry], repair: Repair,
                 lock: IO[bytes] | None) -> None:
        self.out_dir = out_dir
        self.entries = entries
        self.repair = repair
        self._lock = lock

    @classmethod
    def open(cls, out_dir: Path) -> RunStore:
        """Lock, then repair: cut torn tails and adopt records the ledger missed."""
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{out_dir}: cannot create output directory: {e.strerror}") from None
        lock = open(out_dir / LOCK, "a+b")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StoreError(f"{out_dir}: another draftgen run is using this directory") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n".encode())
        lock.flush()
        try:
            entries, repair = _recover(out_dir)
        except OSError as e:
            lock.close()
            raise disk_error(out_dir, e) from None
        return cls(out_dir, entries, repair, lock)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_plan(self, samples: Iterable[Sample], rejected: Iterable[Rejected]) -> None:
        plan = b"".join(
            orjson.dumps({
                "id": s.id, "category": s.category, "partition": s.partition,
                "fingerprint": s.fingerprint, "prompt_tokens": s.prompt_tokens,
                "max_tokens": s.max_tokens, "source": s.source,
                **({"source_id": s.source_id} if s.source_id is not None else {}),
            }) + b"\n"
            for s in samples
        )
        write_atomic(self.out_dir / PLAN, plan)
        write_atomic(self.out_dir / REJECTED,
                     b"".join(orjson.dumps(r) + b"\n" for r in rejected))

    def pending(self, samples: list[Sample], *, retry_failed: bool = False,
                redo_changed: bool = False, redo: Set[str] = frozenset(),
                regenerate: Set[str] = frozenset()) -> list[Sample]:
        """Samples still to send. Refuses to mix records made from different requests,
        except for the ids in `redo`, whose requests were changed on purpose. The ids in
        `regenerate` are sent again whatever their record (their old one stays until the
        new one replaces it, so an interrupted regeneration loses nothing)."""
        changed = [
            s for s in samples
            if (e := self.entries.get(s.id)) is not None and e.fingerprint != s.fingerprint
            and s.id not in redo
        ]
        if changed and not redo_changed:
            raise JobChangedError(
                f"{self.out_dir}: {len(changed)} recorded sample(s) were generated from "
                f"different requests than this job now makes (first: {changed[0].id}); "
                "sampling, max_tokens, model, system prompt or messages changed. Use a new "
                "--out directory, or pass --redo-changed to regenerate those samples."
            )
        todo = []
        for s in samples:
            e = self.entries.get(s.id)
            if (e is None or e.fingerprint != s.fingerprint or s.id in regenerate
                    or (retry_failed and e.status == "failed")):
                todo.append(s)
        return todo

    def read_manifest(self) -> dict[str, Any]:
        return read_manifest(self.out_dir)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        write_atomic(self.out_dir / MANIFEST,
                     orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")


def read_manifest(out_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = orjson.loads((out_dir / MANIFEST).read_bytes())
    except FileNotFoundError:
        return {}
    return data


def _recover(out_dir: Path) -> tuple[dict[str, LedgerEntry], Repair]:
    ledger_path = out_dir / LEDGER
    loaded = load_ledger(ledger_path, repair=True)
    entries = loaded.entries
    covered: dict[str, int] = {}
    for e in entries.values():
        if e.shard is not None:
            covered[e.shard] = max(covered.get(e.shard, 0), e.offset + e.length)
    adopted: list[LedgerEntry] = []
    shard_torn = 0
    for path in shard_paths(out_dir):
        name = f"{path.parent.name}/{path.name}"
        start = covered.get(name, 0)
        if path.stat().st_size <= start:
            continue
        found, torn = scan_tail(path, start)
        for off, length, rec in found:
            e = entry_for(rec, (name, off, length))
            known = entries.get(e.id)
            # A tail record the ledger already has (same shard spot) is not adopted twice.
            if known is None or (known.shard, known.offset) != (e.shard, e.offset):
                adopted.append(e)
                entries[e.id] = e
        if torn:
            truncate(path, path.stat().st_size - torn)
            shard_torn += torn
    if adopted:
        with open(ledger_path, "ab") as f:
            f.write(b"".join(e.to_line() for e in adopted))
            f.flush()
            os.fsync(f.fileno())
    return entries, Repair(loaded.torn_bytes, loaded.corrupt_lines, shard_torn, len(adopted))

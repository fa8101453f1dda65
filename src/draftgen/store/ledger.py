"""The ledger: one small JSON line per outcome, appended; the last line for an id wins."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from draftgen.gcpause import gc_paused


# Not frozen: a frozen dataclass's __init__ costs ~3x more, and a restart builds 10^5 of them.
@dataclass(slots=True)
class LedgerEntry:
    """One outcome. On disk each attribute has a compact key (`KEYS`, in this order)."""

    id: str
    fingerprint: str  # of the request the outcome answers (the plan's `fingerprint`)
    status: str  # "done" | "failed"
    category: str
    partition: str
    shard: str | None = None  # where the record is: shard file, byte offset and length
    offset: int = 0
    length: int = 0
    output_tokens: int = 0
    finish: str | None = None
    truncated: bool = False
    reason: str | None = None
    attempts: int = 0
    time: float = 0.0  # when it finished (unix time)
    # Output check codes (draftgen.quality.checks); None when clean or recorded before checks.
    flags: list[str] | None = None
    # The server configuration that wrote it (an id into the manifest's `configurations`).
    configuration: str | None = None
    # The server that wrote it (through a gateway: the worker that served it).
    server: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LedgerEntry:
        # Positional: ~2x faster than cls(**d) on a 10^5-line ledger. Absent keys were None.
        return cls(*[d.get(k) for k in KEYS])  # type: ignore[arg-type]

    def to_line(self) -> bytes:
        values = ((k, getattr(self, a)) for k, a in _KEYED)
        return orjson.dumps({k: v for k, v in values if v is not None}) + b"\n"


# The ledger's keys, attribute by attribute: what every ledger ever written holds.
KEYS: tuple[str, ...] = ("id", "fp", "status", "cat", "part", "shard", "off", "len", "otok",
                         "finish", "trunc", "reason", "attempts", "t", "flags", "cfg",
                         "srv")
_KEYED: tuple[tuple[str, str], ...] = tuple(zip(KEYS, LedgerEntry.__slots__, strict=True))


@dataclass(slots=True)
class LedgerLoad:
    entries: dict[str, LedgerEntry]
    torn_bytes: int
    corrupt_lines: int


def load_ledger(path: Path, *, repair: bool) -> LedgerLoad:
    """Read the ledger; with `repair`, cut a torn last line (a kill mid-write) from the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LedgerLoad({}, 0, 0)
    with gc_paused():
        loaded = _parse(data)
    if loaded.torn_bytes and repair:
        with open(path, "r+b") as f:
            f.truncate(len(data) - loaded.torn_bytes)
            os.fsync(f.fileno())
    return loaded


def _parse(data: bytes) -> LedgerLoad:
    end = data.rfind(b"\n") + 1
    torn = len(data) - end
    lines = [line for line in data[:end].splitlines() if line]
    entries: dict[str, LedgerEntry] = {}
    corrupt = 0
    try:
        # One parse of the whole file is much faster than 10^5 small ones.
        rows = orjson.loads(b"[" + b",".join(lines) + b"]")
    except orjson.JSONDecodeError:
        rows = []
        for line in lines:
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                corrupt += 1
    for d in rows:
        if not isinstance(d, dict) or "id" not in d:
            corrupt += 1
            continue
        e = LedgerEntry.from_json(d)
        entries[e.id] = e
    return LedgerLoad(entries, torn, corrupt)

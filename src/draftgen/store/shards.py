"""Data shards: full records as JSON lines, appended by one writer, rotated by size."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

SHARD_DIR = "shards"


def shard_paths(out_dir: Path) -> list[Path]:
    d = out_dir / SHARD_DIR
    return sorted(d.glob("*.jsonl")) if d.is_dir() else []


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/{index:05d}.jsonl"


class ShardWriter:
    """Appends records; each append returns where every record landed (shard, offset, length)."""

    def __init__(self, out_dir: Path, *, max_bytes: int = 256 << 20) -> None:
        self._out = out_dir
        self._max_bytes = max_bytes
        (out_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        existing = shard_paths(out_dir)
        self._index = int(existing[-1].stem) if existing else 1
        self._file: BinaryIO | None = None
        self._size = 0

    def _open(self) -> BinaryIO:
        if self._file is None:
            path = self._out / shard_name(self._index)
            self._file = open(path, "ab")
            self._size = self._file.tell()
        return self._file

    def append(self, lines: list[bytes]) -> list[tuple[str, int, int]]:
        """Write and fsync; lines end with a newline."""
        f = self._open()
        if self._size >= self._max_bytes:
            self.close()
            self._index += 1
            f = self._open()
        name = shard_name(self._index)
        spots = []
        for line in lines:
            spots.append((name, self._size, len(line)))
            self._size += len(line)
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
        return spots

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_at(out_dir: Path, shard: str, offset: int, length: int, files: dict[str, BinaryIO]) -> Any:
    f = files.get(shard)
    if f is None:
        f = files[shard] = open(out_dir / shard, "rb")
    f.seek(offset)
    return orjson.loads(f.read(length))


def scan_tail(path: Path, start: int) -> tuple[list[tuple[int, int, dict[str, Any]]], int]:
    """Complete records from `start` to the end, and how many torn bytes follow them."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    end = data.rfind(b"\n") + 1
    found = []
    pos = 0
    for line in _lines(data[:end]):
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            rec = None
        # A record is adoptable only if it parsed whole; anything else is cut with the tail.
        if not isinstance(rec, dict) or "id" not in rec:
            end = pos
            break
        found.append((start + pos, len(line), rec))
        pos += len(line)
    return found, len(data) - end


def _lines(data: bytes) -> Iterator[bytes]:
    pos = 0
    while pos < len(data):
        nl = data.index(b"\n", pos) + 1
        yield data[pos:nl]
        pos = nl


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())

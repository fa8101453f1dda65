"""A model folder built once: written beside its place, swapped in with a stamp that
records what built it, and reused while the stamp matches (every model maker here).

Also the safetensors reading and writing the makers share (bf16 tensors only).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STAMP_NAME = "draftgen-build.json"


def read_stamp(out_dir: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_safetensors(path: Path, tensors: Iterator[tuple[str, list[int], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, shape, data in tensors:
        header[name] = {
            "dtype": "BF16",
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    # The format pads the header with spaces so the data starts 8-byte aligned.
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path: Path) -> Iterator[tuple[str, list[int], bytes]]:
    """(name, shape, bytes) of each bf16 tensor, in file order (as `write_safetensors`)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header: dict[str, Any] = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    start = 8 + size
    for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if meta["dtype"] != "BF16":
            raise ValueError(f"{path}: {name} is {meta['dtype']}, not BF16")
        a, b = meta["data_offsets"]
        yield name, list(meta["shape"]), raw[start + a:start + b]


@contextmanager
def building(out_dir: Path, stamp: dict[str, Any]) -> Iterator[Path]:
    """A folder beside `out_dir` to build in, swapped in stamped when the block ends, so a
    crash never leaves a half-written model that a later run would serve."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        publish(tmp, out_dir, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, out_dir: Path, stamp: dict[str, Any]) -> None:
    """Move a finished build in place, stamped. Another process (a second test run, the
    demo) may have finished the same build meanwhile; its files are identical, so keep them
    rather than pull them from under it."""
    write_json(tmp / STAMP_NAME, stamp)
    if read_stamp(out_dir) == stamp:
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        tmp.rename(out_dir)
    except OSError:
        if read_stamp(out_dir) != stamp:
            raise

"""A model made lossy on purpose: a copy of a model built here with its weight matrices
rounded to a few levels (4 bits: 16), stored in the same dtype. The same model made lossy,
which a quality probe must tell from the original on any machine (a lossy KV cache needs
hardware support).
"""

from __future__ import annotations

import shutil
import struct
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftgen.local.build import (
    STAMP_NAME,
    building,
    read_safetensors,
    read_stamp,
    write_safetensors,
)

ROUNDED_BUILD_VERSION = 1


def build_rounded_model(source_dir: Path, out_dir: Path, *, bits: int = 4,
                        group: int | None = None) -> Path:
    """Copy the model in `source_dir` (built here: the tiny model or SmolLM2) into `out_dir`
    with every weight matrix (embedding, attention, MLP, LM head) rounded to `2**bits`
    levels.

    Symmetric: the levels are `q * s` for the integers `q` in `[-2**(bits-1), 2**(bits-1) -
    1]`, with `s` the largest magnitude over `2**(bits-1) - 1` — of the whole tensor
    (`group` None: the tiny model, whose random weights have no outliers), or of each run
    of `group` values along a row, as 4-bit formats for real models do (Q4_0: 32), which
    leaves a real model a model and not noise; each value takes the nearest level, rounded
    back to bf16. The norms and the tokenizer and config are copied as they are. Reused,
    like the model, when a stamp says the same source, bits and group built it.
    """
    if not 2 <= bits <= 8:
        raise ValueError("bits must be between 2 and 8")
    if group is not None and group < 2:
        raise ValueError("group must be at least 2")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    source_stamp = read_stamp(source_dir)
    if source_stamp is None:
        raise ValueError(f"{source_dir} holds no model built here")
    stamp: dict[str, Any] = {"rounded_build_version": ROUNDED_BUILD_VERSION, "bits": bits,
                             "source": source_stamp}
    if group is not None:
        stamp["group"] = group
    if read_stamp(out_dir) == stamp:
        return out_dir
    with building(out_dir, stamp) as tmp:
        for item in source_dir.iterdir():
            if item.is_file() and item.name not in (STAMP_NAME, "model.safetensors"):
                shutil.copyfile(item, tmp / item.name)
        tensors = read_safetensors(source_dir / "model.safetensors")
        write_safetensors(tmp / "model.safetensors", _rounded(tensors, bits) if group is None
                          else _rounded_groups(tensors, bits, group))
    return out_dir


def _bf16_to_float(bits16: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]
    return value


def _float_to_bf16(value: float) -> int:
    """Round-to-nearest-even from float32 (the values here are finite)."""
    u: int = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _rounded(tensors: Iterator[tuple[str, list[int], bytes]], bits: int
             ) -> Iterator[tuple[str, list[int], bytes]]:
    top = 2 ** (bits - 1) - 1
    for name, shape, data in tensors:
        if len(shape) != 2:
            yield name, shape, data  # the norms
            continue
        values = array("H", data)
        if sys.byteorder != "little":
            values.byteswap()
        # For finite floats the magnitude orders as the bit pattern without the sign.
        amax = _bf16_to_float(max(v & 0x7FFF for v in set(values)))
        scale = amax / top if amax else 1.0
        levels = {}
        for v in set(values):
            q = max(-top - 1, min(top, round(_bf16_to_float(v) / scale)))
            levels[v] = _float_to_bf16(q * scale)
        out = array("H", map(levels.__getitem__, values))
        if sys.byteorder != "little":
            out.byteswap()
        yield name, shape, out.tobytes()




def _rounded_groups(tensors: Iterator[tuple[str, list[int], bytes]], bits: int, group: int
                    ) -> Iterator[tuple[str, list[int], bytes]]:
    import numpy as np  # with the engine: the demo's and the tests' real model only

    top = 2 ** (bits - 1) - 1
    for name, shape, data in tensors:
        if len(shape) != 2 or shape[1] % group:
            yield name, shape, data  # the norms
            continue
        x = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        x = x.reshape(-1, group)
        amax = np.abs(x).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
        y = (np.clip(np.rint(x / scale), -top - 1, top) * scale).astype(np.float32)
        u = y.view(np.uint32)
        # Round to nearest even, to bf16 (the values are finite).
        out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        yield name, shape, out.tobytes()

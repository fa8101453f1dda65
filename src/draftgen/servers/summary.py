"""What a launched server reports, in words: one summary line, and what a restart changed."""

from __future__ import annotations

from typing import Any

from draftgen.engines.dtypes import short_kv_dtype
from draftgen.engines.info import ServerInfo
from draftgen.servers.gpu import GpuMemory, min_headroom_gib


def summary_line(
    info: ServerInfo,
    gpus: list[GpuMemory] | None = None,
    quality_stamp: dict[str, Any] | None = None,
) -> str:
    """`up — 159,277 KV tokens, bf16 KV, 5.47 GiB headroom/GPU (min)`."""
    parts = []
    if info.kv_tokens is not None:
        tokens = f"{info.kv_tokens:,} KV tokens"
        ranks = info.kv_tokens_per_rank
        if len(ranks) > 1:
            same = len(set(ranks)) == 1
            each = f"{len(ranks)} ranks × {ranks[0]:,}" if same else " + ".join(
                f"{r:,}" for r in ranks
            )
            tokens += f" ({each})"
        parts.append(tokens)
    else:
        parts.append("KV capacity not reported")
    parts.append(f"{short_kv_dtype(info.kv_dtype)} KV" if info.kv_dtype else "KV dtype unknown")
    headroom = min_headroom_gib(gpus)
    if headroom is not None:
        parts.append(f"{headroom:.2f} GiB headroom/GPU (min)")
    if quality_stamp:
        parts.append("LOSSY KV CACHE allowed by the profile's quality override")
    return "up — " + ", ".join(parts)


def capacity_change(before: ServerInfo | None, after: ServerInfo) -> str:
    """What a restart changed, one setting per line."""
    if before is None:
        return "no earlier server to compare with"
    lines = []
    if before.kv_tokens != after.kv_tokens:
        lines.append(f"KV tokens: {_num(before.kv_tokens)} → {_num(after.kv_tokens)}"
                     + _delta(before.kv_tokens, after.kv_tokens))
    for label, attr in [
        ("KV dtype", "kv_dtype"),
        ("memory fraction", "mem_fraction"),
        ("max running requests", "max_running_requests"),
        ("context length", "context_length"),
        ("version", "version"),
    ]:
        old, new = getattr(before, attr), getattr(after, attr)
        if old != new:
            lines.append(f"{label}: {_num(old)} → {_num(new)}")
    return "\n".join(lines) if lines else "no change in capacity or settings"


def _num(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _delta(old: int | None, new: int | None) -> str:
    if old is None or new is None or old == 0:
        return ""
    return f" ({new - old:+,}, ×{new / old:.2f})"

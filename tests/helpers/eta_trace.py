"""A run's progress recorded from its run directory, and replayed: what the ETA would have
said at any moment of it, and how long the run really had left.

A trace is one row per sample: [partition, category, start, first token, end, output
tokens], seconds from the run's first send, taken from the records (`finished_at` less the
turns' durations; the first turn's time to first token); tokens are taken to stream
evenly between the first token and the end.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from draftgen.running.eta import RATE_WINDOW_S, PartitionWork, Stream, time_left
from draftgen.schedule.lengths import Lengths


def record_trace(out_dir: Path) -> dict[str, Any]:
    manifest = json.loads((out_dir / "manifest.json").read_text())
    partitions = {name: p["max_tokens"] for name, p in manifest["job"]["partitions"].items()}
    rows = []
    for shard in sorted((out_dir / "shards").glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            rec = json.loads(line)
            turns = rec["turns"]
            start = rec["finished_at"] - sum(t["duration_s"] for t in turns)
            first = start + (turns[0]["ttft_s"] or 0.0)
            rows.append([rec["partition"], rec["category"], start, first, rec["finished_at"],
                         sum(t["completion_tokens"] for t in turns)])
    t0 = min(r[2] for r in rows)
    samples = sorted([[p, c, round(s - t0, 3), round(f - t0, 3), round(e - t0, 3), n]
                      for p, c, s, f, e, n in rows], key=lambda r: r[2])
    return {"partitions": partitions, "samples": samples}


def state_at(trace: dict[str, Any], t: float) -> tuple[list[PartitionWork], Lengths]:
    """What the dispatcher would have handed the ETA at `t` seconds into the run."""
    lengths = Lengths()
    queued: dict[str, Counter[str]] = {p: Counter() for p in trace["partitions"]}
    flights: dict[str, list[Stream]] = {p: [] for p in trace["partitions"]}
    written: dict[str, list[int]] = {}
    for part, cat, start, first, end, tokens in sorted(trace["samples"], key=lambda r: r[4]):
        if end <= t:
            lengths.add(cat, tokens)
        elif start > t:
            queued[part][cat] += 1
        else:
            w = int(streamed(first, end, tokens, t))
            flights[part].append(Stream(cat, w, w))
            written.setdefault(cat, []).append(w)
    lengths.running(written)
    work = [PartitionWork(max_tokens, +queued[p], flights[p])
            for p, max_tokens in trace["partitions"].items()]
    return work, lengths


def streamed(first: float, end: float, tokens: int, t: float) -> float:
    """Tokens a sample had written at `t`."""
    return 0.0 if t <= first else tokens * min(1.0, (t - first) / max(end - first, 1e-9))


def rate_at(trace: dict[str, Any], t: float) -> float:
    """Tokens a second over the RATE_WINDOW_S before `t` (shorter at the run's start)."""
    span = min(float(RATE_WINDOW_S), t)
    if span <= 0:
        return 0.0
    return sum(streamed(f, e, n, t) - streamed(f, e, n, t - span)
               for _, _, _, f, e, n in trace["samples"]) / span


def replay(trace: dict[str, Any], points: int = 40) -> list[tuple[float, float, float | None]]:
    """(t, seconds really left, the ETA) at `points` moments spread over the run."""
    end = max(r[4] for r in trace["samples"])
    out = []
    for i in range(points):
        t = end * i / points
        work, lengths = state_at(trace, t)
        out.append((t, end - t, time_left(work, lengths, rate_at(trace, t))))
    return out

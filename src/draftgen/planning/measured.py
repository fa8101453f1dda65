"""What the capacity model needs, measured: lengths, decode speed, KV capacity.

`Measured` holds it, from either source: a live server (`calibrate.py`) or a run directory
(`measure_from_run` here): prompt lengths from `plan.jsonl`, output lengths and truncations
from the ledger (done samples whose request still matches the plan), and decode speed from
the records' timings: each turn decodes from its first token to its end, so sweeping those
intervals gives, per server, how long each number of requests was decoding at once and how
many tokens came out meanwhile (a request's tokens spread evenly over its decoding time).
KV capacity comes from `timeseries.jsonl` when the run wrote one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from draftgen.errors import StoreError
from draftgen.planning.workload import DecodeSpeed, ServerCapacity
from draftgen.store.reading import current_entries
from draftgen.store.shards import read_at

Group = tuple[str, str]  # (category, partition)
SERIES = "timeseries.jsonl"
# Batch sizes seen for less than this share of the decoding time are too noisy to use.
_MIN_TIME_SHARE = 0.02
_BINS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True, slots=True)
class Measured:
    """Measurements for the capacity model; any part may be missing (None or empty)."""

    prompt_tokens: Mapping[Group, tuple[int, ...]] = field(default_factory=dict)
    output_tokens: Mapping[Group, tuple[int, ...]] = field(default_factory=dict)
    truncated: Mapping[Group, int] = field(default_factory=dict)
    speed: DecodeSpeed | None = None
    kv_tokens: int | None = None  # per server
    block_size: int | None = None
    # The engine's cap on running requests: SGLang publishes it, vLLM does not (its
    # --max-num-seqs defaults to 128 on CPU, 256 to 1024 on GPUs).
    max_running: int | None = None
    servers: int = 1
    source: str = ""
    notes: tuple[str, ...] = ()

    def with_server_from(self, other: Measured) -> Measured:
        """These lengths with `other`'s speed and capacity wherever `other` has them."""
        return replace(
            self,
            speed=other.speed or self.speed,
            kv_tokens=other.kv_tokens or self.kv_tokens,
            block_size=other.block_size or self.block_size,
            max_running=other.max_running or self.max_running,
            source=f"{self.source} + {other.source}",
            notes=self.notes + other.notes,
        )

    def server_capacity(self, *, kv_tokens: int | None = None, servers: int | None = None,
                        max_running: int | None = None) -> ServerCapacity:
        """The model's server; arguments override what was measured (what-if levers)."""
        kv = kv_tokens or self.kv_tokens
        if not kv:
            raise ValueError("KV capacity unknown: measure a server or give kv_tokens")
        return ServerCapacity(
            kv_tokens=kv, speed=self.speed or DecodeSpeed.assumed(),
            servers=servers or self.servers, block_size=self.block_size or 1,
            max_running=max_running or self.max_running)


# --- from a run directory -------------------------------------------------------------

def measure_from_run(out_dir: str | Path) -> Measured:
    out = Path(out_dir)
    plan, entries = current_entries(out)
    prompts: dict[Group, list[int]] = {}
    outputs: dict[Group, list[int]] = {}
    truncated: dict[Group, int] = {}
    spots: list[tuple[str, int, int]] = []
    for row in plan:
        key = (row["category"], row["partition"])
        prompts.setdefault(key, []).append(int(row.get("prompt_tokens") or 0))
        e = entries.get(row["id"])
        if e is None or e.fingerprint != row["fingerprint"] or e.status != "done":
            continue
        outputs.setdefault(key, []).append(int(e.output_tokens))
        truncated[key] = truncated.get(key, 0) + int(bool(e.truncated))
        if e.shard is not None:
            spots.append((e.shard, e.offset, e.length))
    speed = speed_from_records(_read_records(out, spots))
    kv, n_servers = _capacity_from_series(out / SERIES)
    notes = [] if speed else ["no timed records: decode speed unknown"]
    return Measured(
        prompt_tokens={k: tuple(v) for k, v in prompts.items()},
        output_tokens={k: tuple(v) for k, v in outputs.items()},
        truncated=truncated, speed=speed, kv_tokens=kv, servers=n_servers or 1,
        source=f"run {out}", notes=tuple(notes))


def _read_records(out: Path, spots: list[tuple[str, int, int]]) -> Iterable[dict[str, Any]]:
    files: dict[str, BinaryIO] = {}
    try:
        for shard, off, length in sorted(spots):
            try:
                rec = read_at(out, shard, off, length, files)
            except (OSError, orjson.JSONDecodeError) as e:
                raise StoreError(f"{out}: cannot read record in {shard}: {e}") from None
            if isinstance(rec, dict):
                yield rec
    finally:
        for f in files.values():
            f.close()


def decode_intervals(records: Iterable[Mapping[str, Any]],
                     ) -> dict[str, list[tuple[float, float, int]]]:
    """(first token, end, tokens) of every timed turn, per server, on the wall clock.

    The last turn ends at `finished_at`; earlier turns of a multi-turn record are placed
    back to back before it.
    """
    out: dict[str, list[tuple[float, float, int]]] = {}
    for rec in records:
        end = float(rec.get("finished_at") or 0.0)
        server = str(rec.get("server") or "")
        for turn in reversed(rec.get("turns") or []):
            dur = float(turn.get("duration_s") or 0.0)
            ttft = turn.get("ttft_s")
            toks = int(turn.get("completion_tokens") or 0)
            start = end - dur
            if end > 0 and ttft is not None and toks > 1 and dur > float(ttft):
                out.setdefault(server, []).append((start + float(ttft), end, toks))
            end = start
    return out


def speed_from_intervals(intervals: Mapping[str, Sequence[tuple[float, float, int]]],
                         ) -> DecodeSpeed | None:
    """(running, tok/s) points per server from decode intervals, pooled over servers."""
    time_at: dict[int, float] = {}
    tokens_at: dict[int, float] = {}
    for spans in intervals.values():
        events: list[tuple[float, int, float]] = []
        for start, end, toks in spans:
            rate = toks / (end - start)
            events.append((start, 1, rate))
            events.append((end, -1, -rate))
        events.sort(key=lambda e: (e[0], e[1]))
        active, rate_sum, prev = 0, 0.0, None
        for t, d, r in events:
            if prev is not None and active and t > prev:
                time_at[active] = time_at.get(active, 0.0) + (t - prev)
                tokens_at[active] = tokens_at.get(active, 0.0) + rate_sum * (t - prev)
            active += d
            rate_sum += r
            prev = t
    total = sum(time_at.values())
    if total <= 0:
        return None
    binned: dict[int, list[float]] = {}
    for b, secs in time_at.items():
        edge = max(x for x in _BINS if x <= b) if b <= _BINS[-1] else b
        acc = binned.setdefault(edge, [0.0, 0.0, 0.0])
        acc[0] += secs
        acc[1] += b * secs
        acc[2] += tokens_at[b]
    points = tuple((a[1] / a[0], a[2] / a[0]) for a in binned.values()
                   if a[0] >= _MIN_TIME_SHARE * total and a[2] > 0)
    return DecodeSpeed(points, None, "measured from run") if points else None


def speed_from_records(records: Iterable[Mapping[str, Any]]) -> DecodeSpeed | None:
    return speed_from_intervals(decode_intervals(records))


def _capacity_from_series(path: Path) -> tuple[int | None, int | None]:
    """The largest KV capacity any server reported, and how many servers were seen."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    caps: dict[str, int] = {}
    for line in data.splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last line of a running job
        for url, s in (row.get("servers") or {}).items():
            cap = s.get("capacity") or s.get("kv_tokens")
            if cap:
                caps[url] = max(caps.get(url, 0), int(cap))
    return (max(caps.values()) if caps else None), (len(caps) or None)

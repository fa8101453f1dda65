"""A server's load, whichever engine: `ServerLoad`, and the Prometheus `/metrics` reading
every engine shares (series deduplicated per DP rank / engine and summed across them),
driven by each engine's `MetricNames`. Each engine parses its own JSON load endpoint; the
poller (`client/load.py`) decides which to ask."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import orjson
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class ServerLoad:
    url: str
    at: float  # monotonic time of the poll (the poller's clock)
    kv_capacity_tokens: int | None  # total over DP ranks / engines
    kv_used_tokens: int | None
    kv_usage: float | None  # 0..1, the server's own figure where it has one
    running: int | None
    waiting: int | None
    # Cumulative: vLLM preemptions; SGLang retracted requests (only from its /metrics).
    preemptions_total: int | None
    generation_tokens_total: int | None
    # vLLM: count of the iteration_tokens_total histogram, i.e. engine steps.
    engine_steps_total: int | None
    source: str  # which endpoint(s) answered, e.g. "sglang /v1/loads", "vllm /metrics"
    missing: tuple[str, ...]  # fields it could not see
    # KV is allocated in blocks of this many tokens (vLLM's block_size); None: per token.
    kv_block_tokens: int | None = None
    # The server's own limit on requests running at once, where it publishes one (SGLang
    # /v1/loads `max_running_requests`, summed over DP ranks; vLLM does not).
    max_running: int | None = None


# The reading fields of ServerLoad, in declaration order.
FIELDS: tuple[str, ...] = (
    "kv_capacity_tokens", "kv_used_tokens", "kv_usage", "running", "waiting",
    "preemptions_total", "generation_tokens_total", "engine_steps_total",
)
COUNTERS = ("preemptions_total", "generation_tokens_total", "engine_steps_total")


@dataclass(frozen=True)
class MetricNames:
    """One engine's Prometheus names (as written in the text, `_total`/`_count` included).

    `sums`: sample name → field, summed over replicas; earlier names win where two mean
    the same thing. `usage`: KV usage gauges (0..1), the first found wins. Capacity comes
    from the labels of `capacity_info` (KV tokens, or blocks × block size) or from the
    series `capacity_series`."""

    engine: str
    prefix: str
    sums: Mapping[str, str]
    usage: tuple[str, ...]
    capacity_info: str | None = None
    capacity_series: str | None = None

    def wanted(self) -> frozenset[str]:
        return frozenset([*self.sums, *self.usage,
                          *(n for n in (self.capacity_info, self.capacity_series) if n)])


# Labels that tell data-parallel replicas apart; every other label (tp_rank, pp_rank, pid,
# model_name, …) is a copy of the same figure.
_REPLICA_LABELS = ("dp_rank", "engine")
# Labels that split one figure into parts to be summed (0.5.23's token counters).
_SERIES_LABELS = (*_REPLICA_LABELS, "is_streaming")
Reading = dict[str, float]
K = TypeVar("K")


def number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def weighted_usage(usage: Mapping[K, float], capacity: Mapping[K, float]) -> float | None:
    """Usage over several replicas, weighted by their capacity where both are known."""
    if not usage:
        return None
    matched = pairs(usage, capacity)
    if matched is not None and sum(c for _, c in matched) > 0:
        return sum(u * c for u, c in matched) / sum(c for _, c in matched)
    return sum(usage.values()) / len(usage)


def pairs(usage: Mapping[K, float],
          capacity: Mapping[K, float]) -> list[tuple[float, float]] | None:
    if usage.keys() == capacity.keys():
        return [(u, capacity[k]) for k, u in usage.items()]
    # Older vLLM labels its cache info without the engine label its gauges carry.
    if len(usage) == 1 and len(capacity) == 1:
        return [(next(iter(usage.values())), next(iter(capacity.values())))]
    return None


def read_prometheus(text: str, tables: Sequence[MetricNames],
                    wanted: frozenset[str]) -> tuple[Reading, MetricNames | None]:
    """The load fields found in a Prometheus text page, and whose names it uses (one of
    `tables`; `wanted` is the union of their names).

    Only the lines of the metrics we use reach the parser: a vLLM page is ~600 lines of
    histograms, and this runs every second per server.
    """
    kept = [line for line in text.splitlines() if sample_name(line) in wanted]
    info_names = {t.capacity_info for t in tables if t.capacity_info}
    # name → series → value; copies of one series (TP/PP ranks) collapse by max, and the
    # series are summed (replicas; SGLang 0.5.23 counts streamed and plain requests apart).
    series: dict[str, dict[tuple[str, ...], float]] = {}
    capacity: dict[tuple[str, ...], float] = {}
    info_seen: set[str] = set()
    reading_extra: Reading = {}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for s in family.samples:
            replica = tuple(s.labels.get(k, "") for k in _SERIES_LABELS)
            if s.name in info_names:
                tokens = _cache_info_tokens(s.labels)
                if tokens is not None:
                    capacity[replica] = tokens
                    info_seen.add(s.name)
                with contextlib.suppress(KeyError, ValueError):
                    reading_extra["kv_block_tokens"] = float(s.labels["block_size"])
                continue
            value = number(s.value)
            if value is not None:
                per = series.setdefault(s.name, {})
                per[replica] = max(value, per.get(replica, value))
    table = next((t for t in tables if t.capacity_info in info_seen
                  or any(n.startswith(t.prefix) for n in series)), None)
    reading: Reading = dict(reading_extra)
    if table is None:
        return reading, None
    for name, fieldname in table.sums.items():
        if name in series and fieldname not in reading:
            reading[fieldname] = sum(series[name].values())
    usage = next((series[n] for n in table.usage if n in series), {})
    if table.capacity_series:
        capacity = series.get(table.capacity_series, {})
    elif capacity:
        reading["kv_capacity_tokens"] = sum(capacity.values())
        matched = pairs(usage, capacity)
        if matched is not None:
            reading["kv_used_tokens"] = sum(u * c for u, c in matched)
    put_usage(reading, weighted_usage(usage, capacity))
    return reading, table


def sample_name(line: str) -> str:
    """The name a Prometheus sample line starts with; "" for a comment or a blank line."""
    if not line or line[0] == "#":
        return ""
    end = len(line)
    for stop in ("{", " "):
        i = line.find(stop)
        if i != -1:
            end = min(end, i)
    return line[:end]


def split_by_label(text: str, label: str,
                   wanted: frozenset[str] | None = None) -> dict[str, str]:
    """The sample lines of a Prometheus page grouped by the value of one `label` (a
    gateway's `worker_addr`): each group a page of its own, as `read_prometheus` reads one.
    Lines without the label are left out, and so are the samples not in `wanted` (if
    given). The label stays on each line: to the readers it is one more copy label."""
    key = f'{label}="'
    parts: dict[str, list[str]] = {}
    for line in text.splitlines():
        name = sample_name(line)
        if not name or (wanted is not None and name not in wanted):
            continue
        i = line.find(key, len(name))
        if i == -1 or line[i - 1] not in "{,":
            continue
        start = i + len(key)
        end = line.find('"', start)
        if end != -1:
            parts.setdefault(line[start:end], []).append(line)
    return {value: "\n".join(lines) + "\n" for value, lines in parts.items()}


def server_load(url: str, at: float, reading: Reading, source: str) -> ServerLoad:
    """A reading as a `ServerLoad`: counts rounded to whole numbers, the reading fields it
    lacks named in `missing`."""

    def whole(f: str) -> int | None:
        v = reading.get(f)
        return None if v is None else round(v)

    return ServerLoad(
        url=url, at=at,
        kv_capacity_tokens=whole("kv_capacity_tokens"),
        kv_used_tokens=whole("kv_used_tokens"),
        kv_usage=reading.get("kv_usage"),
        running=whole("running"), waiting=whole("waiting"),
        preemptions_total=whole("preemptions_total"),
        generation_tokens_total=whole("generation_tokens_total"),
        engine_steps_total=whole("engine_steps_total"),
        source=source, missing=tuple(f for f in FIELDS if f not in reading),
        kv_block_tokens=whole("kv_block_tokens"),
        max_running=whole("max_running"),
    )


def _cache_info_tokens(labels: Mapping[str, str]) -> float | None:
    try:
        return float(labels["kv_cache_size_tokens"])
    except (KeyError, ValueError):
        pass
    try:
        return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
    except (KeyError, ValueError):
        return None


def put_usage(reading: Reading, usage: float | None) -> None:
    if usage is not None:
        reading["kv_usage"] = usage
        return
    used, cap = reading.get("kv_used_tokens"), reading.get("kv_capacity_tokens")
    if used is not None and cap:
        reading["kv_usage"] = used / cap


def parse_json(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None

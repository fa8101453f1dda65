"""What each engine's load endpoints say, parsed into one `ServerLoad`: SGLang's
`/v1/loads` and `/server_info`, and Prometheus `/metrics` of vLLM or SGLang (series
deduplicated per DP rank / engine and summed across them). `load.py` decides which to ask."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import orjson
from prometheus_client.parser import text_string_to_metric_families

from draftgen.servers.sglang import per_rank_capacity


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

# Prometheus sample names (as written in the text, `_total`/`_count` included) → field.
# Earlier names win where two mean the same thing.
_VLLM_SUMS: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:iteration_tokens_total_count": "engine_steps_total",
}
_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_SGLANG_SUMS: dict[str, str] = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_used_tokens": "kv_used_tokens",
    "sglang:max_total_num_tokens": "kv_capacity_tokens",
    "sglang:num_retracted_requests_total": "preemptions_total",
    "sglang:generation_tokens_total": "generation_tokens_total",
}
_SGLANG_USAGE = ("sglang:token_usage",)
_WANTED = frozenset(
    [*_VLLM_SUMS, *_VLLM_USAGE, _VLLM_CACHE_INFO, *_SGLANG_SUMS, *_SGLANG_USAGE]
)
# Labels that tell data-parallel replicas apart; every other label (tp_rank, pp_rank, pid,
# model_name, …) is a copy of the same figure.
_REPLICA_LABELS = ("dp_rank", "engine")
# Labels that split one figure into parts to be summed (0.5.23's token counters).
_SERIES_LABELS = (*_REPLICA_LABELS, "is_streaming")
_V1_LOADS: dict[str, str] = {
    "num_running_reqs": "running",
    "num_waiting_reqs": "waiting",
    "num_used_tokens": "kv_used_tokens",
    "max_total_num_tokens": "kv_capacity_tokens",
    "max_running_requests": "max_running",
}

# /v1/loads fields that are the same on every rank once it has published.
_SIZED_ALIKE = ("max_total_num_tokens", "max_running_requests")

Reading = dict[str, float]
K = TypeVar("K")
Engine = Literal["vllm", "sglang"]


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _usage(usage: Mapping[K, float], capacity: Mapping[K, float]) -> float | None:
    """Usage over several replicas, weighted by their capacity where both are known."""
    if not usage:
        return None
    pairs = _pairs(usage, capacity)
    if pairs is not None and sum(c for _, c in pairs) > 0:
        return sum(u * c for u, c in pairs) / sum(c for _, c in pairs)
    return sum(usage.values()) / len(usage)


def _pairs(usage: Mapping[K, float],
           capacity: Mapping[K, float]) -> list[tuple[float, float]] | None:
    if usage.keys() == capacity.keys():
        return [(u, capacity[k]) for k, u in usage.items()]
    # Older vLLM labels its cache info without the engine label its gauges carry.
    if len(usage) == 1 and len(capacity) == 1:
        return [(next(iter(usage.values())), next(iter(capacity.values())))]
    return None


def read_prometheus(text: str) -> tuple[Reading, Engine | None]:
    """The load fields found in a Prometheus text page, and whose page it is.

    Only the lines of the metrics we use reach the parser: a vLLM page is ~600 lines of
    histograms, and this runs every second per server.
    """
    kept = []
    for line in text.splitlines():
        if line and line[0] != "#":
            end = len(line)
            for stop in ("{", " "):
                i = line.find(stop)
                if i != -1:
                    end = min(end, i)
            if line[:end] in _WANTED:
                kept.append(line)
    # name → series → value; copies of one series (TP/PP ranks) collapse by max, and the
    # series are summed (replicas; SGLang 0.5.23 counts streamed and plain requests apart).
    series: dict[str, dict[tuple[str, ...], float]] = {}
    capacity: dict[tuple[str, ...], float] = {}
    reading_extra: Reading = {}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for s in family.samples:
            replica = tuple(s.labels.get(k, "") for k in _SERIES_LABELS)
            if s.name == _VLLM_CACHE_INFO:
                tokens = _cache_info_tokens(s.labels)
                if tokens is not None:
                    capacity[replica] = tokens
                with contextlib.suppress(KeyError, ValueError):
                    reading_extra["kv_block_tokens"] = float(s.labels["block_size"])
                continue
            value = _number(s.value)
            if value is not None:
                per = series.setdefault(s.name, {})
                per[replica] = max(value, per.get(replica, value))
    engine: Engine | None = None
    if any(n.startswith("vllm:") for n in series) or capacity:
        engine = "vllm"
    elif any(n.startswith("sglang:") for n in series):
        engine = "sglang"
    reading: Reading = dict(reading_extra)
    for name, fieldname in (_VLLM_SUMS if engine == "vllm" else _SGLANG_SUMS).items():
        if name in series and fieldname not in reading:
            reading[fieldname] = sum(series[name].values())
    usage_names = _VLLM_USAGE if engine == "vllm" else _SGLANG_USAGE
    usage = next((series[n] for n in usage_names if n in series), {})
    if engine == "sglang":
        capacity = series.get("sglang:max_total_num_tokens", {})
    elif capacity:
        reading["kv_capacity_tokens"] = sum(capacity.values())
        pairs = _pairs(usage, capacity)
        if pairs is not None:
            reading["kv_used_tokens"] = sum(u * c for u, c in pairs)
    put_usage(reading, _usage(usage, capacity))
    return reading, engine


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


def read_sglang_loads(body: object) -> Reading | None:
    """The load fields of a `/v1/loads` answer, summed over DP ranks; None if not one."""
    ranks = body.get("loads") if isinstance(body, dict) else body
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        return None
    reading: Reading = {}
    for key, fieldname in _V1_LOADS.items():
        values = [_number(r.get(key)) for r in ranks]
        if key in _SIZED_ALIKE and any(values):
            # 0.5.23 shows a rank's slot as zeros until its scheduler first publishes; every
            # rank's pool and limit are sized alike.
            values = [v or max(x for x in values if x) for v in values]
        if ranks and all(v is not None for v in values):
            reading[fieldname] = sum(v for v in values if v is not None)
    usage: dict[int, float] = {}
    capacity: dict[int, float] = {}
    for i, r in enumerate(ranks):
        if (u := _number(r.get("token_usage"))) is not None:
            usage[i] = u
        if (c := _number(r.get("max_total_num_tokens"))) is not None:
            capacity[i] = c
    put_usage(reading, _usage(usage, capacity) if len(usage) == len(ranks) else None)
    return reading


def read_server_info(body: object) -> float | None:
    """KV capacity in tokens over all DP ranks from SGLang's server info, if it says."""
    if not isinstance(body, dict):
        return None
    ranks = per_rank_capacity(body)
    return float(sum(ranks)) if ranks else None


def parse_json(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def parse_prometheus(body: bytes) -> tuple[Reading, Engine | None]:
    try:
        return read_prometheus(body.decode("utf-8", "replace"))
    except ValueError:  # the parser's only complaint about malformed lines
        return {}, None

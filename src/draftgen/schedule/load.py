"""What a server says about its own load: KV capacity and usage, queue, preemptions.

One `LoadPoller` per server URL. On its first answer it finds out which endpoint the server
has, in this order, and then keeps asking only that one:

- SGLang ≥ 0.5.8 `GET /v1/loads`: one entry per DP rank, summed. Its retraction figure is a
  gauge of the last retraction, not a running count, so when `/metrics` also answers
  (`--enable-metrics`) the cumulative counters are read from there as well.
- `GET /metrics` in Prometheus text: vLLM (always on) or SGLang with `--enable-metrics`.
  Series are deduplicated per DP rank / engine (tensor- and pipeline-parallel ranks repeat
  the same gauge) and summed across them.
- SGLang `GET /server_info` (older `/get_server_info`): capacity only.

A field the server does not publish is None and named in `ServerLoad.missing`; the poller
says so through `log` once per distinct set of missing fields, not on every poll. A server
that does not answer at all gives None; HTTP errors and unparseable bodies give a reading
with the fields missing, never an exception, so a polling loop needs no guard.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from draftgen.clock import Clock


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
_COUNTERS = ("preemptions_total", "generation_tokens_total", "engine_steps_total")

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
    "sglang:num_retracted_reqs_total": "preemptions_total",
    "sglang:generation_tokens_total": "generation_tokens_total",
}
_SGLANG_USAGE = ("sglang:token_usage",)
_WANTED = frozenset(
    [*_VLLM_SUMS, *_VLLM_USAGE, _VLLM_CACHE_INFO, *_SGLANG_SUMS, *_SGLANG_USAGE]
)
# Labels that tell data-parallel replicas apart; every other label (tp_rank, pp_rank, pid,
# model_name, …) is a copy of the same figure.
_REPLICA_LABELS = ("dp_rank", "engine")
_V1_LOADS: dict[str, str] = {
    "num_running_reqs": "running",
    "num_waiting_reqs": "waiting",
    "num_used_tokens": "kv_used_tokens",
    "max_total_num_tokens": "kv_capacity_tokens",
    "max_running_requests": "max_running",
}

Reading = dict[str, float]
K = TypeVar("K")
Engine = Literal["vllm", "sglang"]
_Plan = Literal["sglang_loads", "sglang_metrics", "sglang_info", "vllm_metrics", "none"]
_SOURCES: dict[_Plan, str] = {
    "sglang_loads": "sglang /v1/loads",
    "sglang_metrics": "sglang /metrics",
    "sglang_info": "sglang /server_info",
    "vllm_metrics": "vllm /metrics",
    "none": "no load endpoint",
}


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
    # name → replica → value; copies of one replica (TP/PP ranks) collapse by max.
    series: dict[str, dict[tuple[str, ...], float]] = {}
    capacity: dict[tuple[str, ...], float] = {}
    reading_extra: Reading = {}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for s in family.samples:
            replica = tuple(s.labels.get(k, "") for k in _REPLICA_LABELS)
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
    _put_usage(reading, _usage(usage, capacity))
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


def _put_usage(reading: Reading, usage: float | None) -> None:
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
        if ranks and all(v is not None for v in values):
            reading[fieldname] = sum(v for v in values if v is not None)
    usage: dict[int, float] = {}
    capacity: dict[int, float] = {}
    for i, r in enumerate(ranks):
        if (u := _number(r.get("token_usage"))) is not None:
            usage[i] = u
        if (c := _number(r.get("max_total_num_tokens"))) is not None:
            capacity[i] = c
    _put_usage(reading, _usage(usage, capacity) if len(usage) == len(ranks) else None)
    return reading


def read_server_info(body: object) -> float | None:
    """KV capacity in tokens over all DP ranks from SGLang's server info, if it says."""
    if not isinstance(body, dict):
        return None
    states = body.get("internal_states")
    if isinstance(states, list) and states:
        per_rank = [_number(s.get("max_total_num_tokens")) if isinstance(s, dict) else None
                    for s in states]
        if all(v is not None for v in per_rank):
            return sum(v for v in per_rank if v is not None)
    per_rank_top = _number(body.get("max_total_num_tokens"))
    if per_rank_top is None:
        return None
    return per_rank_top * (_number(body.get("dp_size")) or 1.0)


class _NoAnswer(Exception):
    """The server did not answer: refused, reset, or timed out."""


def _json(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _prometheus(body: bytes) -> tuple[Reading, Engine | None]:
    try:
        return read_prometheus(body.decode("utf-8", "replace"))
    except ValueError:  # the parser's only complaint about malformed lines
        return {}, None


class LoadPoller:
    """Polls one server's load; one `poll()` at a time."""

    def __init__(self, session: aiohttp.ClientSession, url: str, *, clock: Clock,
                 timeout_s: float = 5.0, log: Callable[[str], None] | None = None) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._log = log
        self._plan: _Plan | None = None
        # False while the answer may still change: nothing found yet, or /v1/loads failed
        # with a server error (SGLang answers 503 while it starts).
        self._settled = False
        # SGLang /v1/loads lacks cumulative counters; its /metrics has them when enabled.
        self._metrics_too = False
        self._info_capacity: float | None = None
        self._info_tried = False
        self._logged: set[tuple[str, ...]] = set()

    @property
    def source(self) -> str | None:
        """The endpoint found so far, or None before the server first answered."""
        return None if self._plan is None else _SOURCES[self._plan]

    async def poll(self) -> ServerLoad | None:
        at = self._clock.monotonic()
        try:
            if not self._settled:
                await self._detect()
            found = await self._read()
            if found is None:  # the endpoint went away: another server answers there now
                await self._detect()
                found = await self._read() or ({}, f"{self.source} (gone)")
        except _NoAnswer:
            return None
        reading, source = found
        missing = tuple(f for f in FIELDS if f not in reading)
        if missing and missing not in self._logged:
            self._logged.add(missing)
            self._say(f"{self.url}: load from {source} lacks {', '.join(missing)}")

        def whole(f: str) -> int | None:
            v = reading.get(f)
            return None if v is None else round(v)

        return ServerLoad(
            url=self.url, at=at,
            kv_capacity_tokens=whole("kv_capacity_tokens"),
            kv_used_tokens=whole("kv_used_tokens"),
            kv_usage=reading.get("kv_usage"),
            running=whole("running"), waiting=whole("waiting"),
            preemptions_total=whole("preemptions_total"),
            generation_tokens_total=whole("generation_tokens_total"),
            engine_steps_total=whole("engine_steps_total"),
            source=source, missing=missing, kv_block_tokens=whole("kv_block_tokens"),
            max_running=whole("max_running"),
        )

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log(message)

    async def _get(self, path: str, accept: str) -> tuple[int, bytes]:
        try:
            # Accept overrides a client session's event-stream default; text/plain also
            # keeps a Prometheus endpoint from switching to OpenMetrics.
            async with self._session.get(self.url + path, timeout=self._timeout,
                                         headers={"Accept": accept}) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise _NoAnswer(str(e)) from e

    async def _detect(self) -> None:
        plan: _Plan = "none"
        self._metrics_too = False
        self._info_tried = False
        status, body = await self._get("/v1/loads", "application/json")
        self._settled = status < 500
        if status == 200 and read_sglang_loads(_json(body)) is not None:
            plan = "sglang_loads"
            status, body = await self._get("/metrics", "text/plain")
            reading = _prometheus(body)[0] if status == 200 else {}
            self._metrics_too = any(f in reading for f in _COUNTERS)
        else:
            status, body = await self._get("/metrics", "text/plain")
            engine = _prometheus(body)[1] if status == 200 else None
            if engine is not None:
                plan = "vllm_metrics" if engine == "vllm" else "sglang_metrics"
            elif (await self._server_info())[1] is not None:
                plan = "sglang_info"
        self._settled = self._settled and plan != "none"
        if plan != self._plan:
            extra = " + /metrics" if self._metrics_too else ""
            self._say(f"{self.url}: load from {_SOURCES[plan]}{extra}")
        self._plan = plan

    async def _server_info(self) -> tuple[int, float | None]:
        """Status of the first server-info path that exists (else 404), and its capacity."""
        status, body = 404, b""
        for path in ("/server_info", "/get_server_info"):
            status, body = await self._get(path, "application/json")
            if status != 404:
                break
        return status, read_server_info(_json(body)) if status == 200 else None

    async def _read(self) -> tuple[Reading, str] | None:
        """This poll's reading and its source; None when the endpoint is gone (404)."""
        assert self._plan is not None
        source = _SOURCES[self._plan]
        if self._plan == "none":
            return {}, source
        if self._plan == "sglang_info":
            status, capacity = await self._server_info()
            if status == 404:
                return None
            if status != 200:
                source += f" (HTTP {status})"
            return ({} if capacity is None else {"kv_capacity_tokens": capacity}), source
        json = self._plan == "sglang_loads"
        path = "/v1/loads" if json else "/metrics"
        status, body = await self._get(path, "application/json" if json else "text/plain")
        if status == 404:
            return None
        if status != 200:
            return {}, f"{source} (HTTP {status})"
        if not json:
            reading = _prometheus(body)[0]
            if self._plan == "sglang_metrics" and "kv_capacity_tokens" not in reading:
                source += await self._add_info_capacity(reading)
            return reading, source
        reading = read_sglang_loads(_json(body)) or {}
        if self._metrics_too:
            try:
                status, body = await self._get("/metrics", "text/plain")
            except _NoAnswer:  # the server did answer; keep what /v1/loads said
                status = 0
            if status == 200:
                counters = _prometheus(body)[0]
                reading.update({f: counters[f] for f in _COUNTERS if f in counters})
                source += " + /metrics"
        return reading, source

    async def _add_info_capacity(self, reading: Reading) -> str:
        """Capacity from /server_info, asked once: it does not change while a server runs."""
        if not self._info_tried:
            self._info_tried = True
            self._info_capacity = (await self._server_info())[1]
        if self._info_capacity is None:
            return ""
        reading["kv_capacity_tokens"] = self._info_capacity
        if "kv_usage" not in reading:
            _put_usage(reading, None)
        return " + /server_info"

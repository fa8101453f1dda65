"""SGLang's load: `/v1/loads` (0.5.8+, one entry per DP rank), its Prometheus names
(`--enable-metrics`), and the capacity `/server_info` gives."""

from __future__ import annotations

from draftgen.engines.load import (
    MetricNames,
    Reading,
    number,
    put_usage,
    weighted_usage,
)
from draftgen.engines.sglang.info import per_rank_capacity

METRICS = MetricNames(
    engine="sglang",
    prefix="sglang:",
    sums={
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "waiting",
        "sglang:num_used_tokens": "kv_used_tokens",
        "sglang:max_total_num_tokens": "kv_capacity_tokens",
        "sglang:num_retracted_requests_total": "preemptions_total",
        "sglang:generation_tokens_total": "generation_tokens_total",
    },
    usage=("sglang:token_usage",),
    capacity_series="sglang:max_total_num_tokens",
)

_V1_LOADS: dict[str, str] = {
    "num_running_reqs": "running",
    "num_waiting_reqs": "waiting",
    "num_used_tokens": "kv_used_tokens",
    "max_total_num_tokens": "kv_capacity_tokens",
    "max_running_requests": "max_running",
}
# /v1/loads fields that are the same on every rank once it has published.
_SIZED_ALIKE = ("max_total_num_tokens", "max_running_requests")


def read_loads(body: object) -> Reading | None:
    """The load fields of a `/v1/loads` answer, summed over DP ranks; None if not one."""
    ranks = body.get("loads") if isinstance(body, dict) else body
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        return None
    reading: Reading = {}
    for key, fieldname in _V1_LOADS.items():
        values = [number(r.get(key)) for r in ranks]
        if key in _SIZED_ALIKE and any(values):
            # 0.5.23 shows a rank's slot as zeros until its scheduler first publishes; every
            # rank's pool and limit are sized alike.
            values = [v or max(x for x in values if x) for v in values]
        if ranks and all(v is not None for v in values):
            reading[fieldname] = sum(v for v in values if v is not None)
    usage: dict[int, float] = {}
    capacity: dict[int, float] = {}
    for i, r in enumerate(ranks):
        if (u := number(r.get("token_usage"))) is not None:
            usage[i] = u
        if (c := number(r.get("max_total_num_tokens"))) is not None:
            capacity[i] = c
    put_usage(reading, weighted_usage(usage, capacity) if len(usage) == len(ranks) else None)
    return reading


def info_capacity(body: object) -> float | None:
    """KV capacity in tokens over all DP ranks from SGLang's server info, if it says."""
    if not isinstance(body, dict):
        return None
    ranks = per_rank_capacity(body)
    return float(sum(ranks)) if ranks else None

"""SGLang's `/server_info` read back into a `ServerInfo`.

`/server_info` (older: `/get_server_info`) returns every server argument plus the
scheduler's `max_total_num_tokens` — the KV capacity of one data-parallel rank — and
`internal_states`, one per rank. `/v1/loads` (0.5.8+) gives each rank's capacity too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from draftgen.engines.common import (
    as_float,
    as_int,
    as_str,
    model_max_len,
    resolve_auto_kv_dtype,
)
from draftgen.engines.dtypes import AUTO, canonical_kv_dtype
from draftgen.engines.info import ServerInfo

# Server arguments recorded with the info: the ones that decide capacity and quality.
RECORDED_ARGS = (
    "model_path", "served_model_name", "tp_size", "dp_size", "enable_dp_attention",
    "attn_dp_size", "enable_deterministic_inference",
    "mem_fraction_static", "kv_cache_dtype", "dtype", "quantization",
    "enable_hierarchical_cache", "hicache_size", "hicache_ratio", "max_running_requests",
    "context_length", "chunked_prefill_size", "page_size", "reasoning_parser",
    "attention_backend", "speculative_algorithm", "disable_radix_cache", "schedule_policy",
    "max_total_num_tokens", "max_req_input_len",
)  # fmt: skip



def is_sglang_server_info(data: Any) -> bool:
    return isinstance(data, dict) and ("max_total_num_tokens" in data or "tp_size" in data)


def rank_loads(loads: Any) -> list[Mapping[str, Any]]:
    """Per-rank entries of a `/v1/loads` answer (`{"loads": [...]}` or a bare list)."""
    entries = loads.get("loads") if isinstance(loads, dict) else loads
    if not isinstance(entries, list):
        return []
    ranked = [e for e in entries if isinstance(e, dict)]
    return sorted(ranked, key=lambda e: as_int(e.get("dp_rank")) or 0)


def dp_ranks(data: Mapping[str, Any], loads: Any = None) -> int:
    """Data-parallel ranks, each with its own KV pool and scheduler: one `/v1/loads` entry
    each, else `dp_size × attn_dp_size` (0.5.23 turns `--dp-size 8 --enable-dp-attention`
    into dp_size 1, attn_dp_size 8)."""
    entries = rank_loads(loads)
    if entries:
        return len(entries)
    return max(1, as_int(data.get("dp_size")) or 1) * max(1, as_int(data.get("attn_dp_size")) or 1)


def per_rank_capacity(data: Mapping[str, Any], loads: Any = None) -> tuple[int, ...]:
    """KV tokens of each data-parallel rank, from the most specific source there is.

    Every rank sizes its pool alike, so a rank that reads 0 (0.5.23 publishes a slot's
    figures only once its scheduler has run) takes the others' size."""
    from_loads = [as_int(e.get("max_total_num_tokens")) for e in rank_loads(loads)]
    if from_loads and all(v is not None for v in from_loads) and any(from_loads):
        return tuple(_sized_alike(from_loads))
    states = data.get("internal_states")
    if isinstance(states, list) and states:
        from_states = [_state_capacity(s) for s in states]
        if all(v is not None for v in from_states) and len(from_states) == dp_ranks(data, loads):
            return tuple(v for v in from_states if v is not None)
    per_rank = as_int(data.get("max_total_num_tokens"))
    if per_rank is None:
        return ()
    # scheduler_info reports rank 0's pool.
    return (per_rank,) * dp_ranks(data, loads)


def _sized_alike(values: Sequence[int | None]) -> list[int]:
    """Per-rank figures where a rank that has not published yet (0.5.23 shows zeros) takes
    the others' value: every rank's pool and limit are sized alike."""
    known = max((v for v in values if v), default=0)
    return [v or known for v in values]


def parse_server_info(
    url: str, data: Mapping[str, Any], loads: Any = None, models: Any = None
) -> ServerInfo:
    """`data` from /server_info; `loads` from /v1/loads and `models` from /v1/models, if any."""
    setting = data.get("kv_cache_dtype")
    model_path = as_str(data.get("model_path"))
    if not isinstance(setting, str):
        kv_dtype, note = None, "the server did not report kv_cache_dtype"
    elif canonical_kv_dtype(setting) == AUTO:
        kv_dtype, note = resolve_auto_kv_dtype(model_path, as_str(data.get("dtype")))
    else:
        kv_dtype, note = setting, "server_info kv_cache_dtype"
    ranks = per_rank_capacity(data, loads)
    rank_max = [as_int(e.get("max_running_requests")) for e in rank_loads(loads)]
    max_running = (
        sum(_sized_alike(rank_max))
        if rank_max and all(v is not None for v in rank_max) and any(rank_max)
        else as_int(data.get("max_running_requests"))
    )
    served = data.get("served_model_name")
    return ServerInfo(
        url=url,
        engine="sglang",
        version=as_str(data.get("version")),
        model=as_str(served[0] if isinstance(served, Sequence) and not isinstance(served, str)
                   else served) or model_path,
        model_path=model_path,
        kv_dtype=canonical_kv_dtype(kv_dtype) if kv_dtype else None,
        kv_dtype_setting=setting if isinstance(setting, str) else None,
        kv_dtype_note=note,
        kv_tokens=sum(ranks) if ranks else None,
        kv_tokens_per_rank=ranks,
        max_running_requests=max_running,
        mem_fraction=as_float(data.get("mem_fraction_static")),
        context_length=as_int(data.get("context_length")) or model_max_len(models),
        tp=as_int(data.get("tp_size")),
        dp=as_int(data.get("dp_size")),
        attn_dp=as_int(data.get("attn_dp_size")),
        seeds_honoured=data.get("enable_deterministic_inference") is True,
        args={k: data[k] for k in RECORDED_ARGS if k in data},
    )



def _state_capacity(state: Any) -> int | None:
    """One rank's capacity in `internal_states`: `memory_usage.token_capacity` (no release
    has a `max_total_num_tokens` of its own there)."""
    usage = state.get("memory_usage") if isinstance(state, dict) else None
    value = as_int(usage.get("token_capacity")) if isinstance(usage, dict) else None
    return value or None

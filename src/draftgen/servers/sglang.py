"""SGLang: `python -m sglang.launch_server …`, and its `/server_info` read back.

`/server_info` (older: `/get_server_info`) returns every server argument plus the
scheduler's `max_total_num_tokens` — the KV capacity of one data-parallel rank — and
`internal_states`, one per rank. `/v1/loads` (0.5.8+) gives each rank's capacity too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import aiohttp

from draftgen.servers.base import (
    Engine,
    ServerInfo,
    ServerInfoError,
    as_float,
    as_int,
    as_str,
    common_flags,
    get_json,
    model_max_len,
    resolve_auto_kv_dtype,
)
from draftgen.servers.dtypes import AUTO, canonical_kv_dtype
from draftgen.servers.install import EngineInstall
from draftgen.servers.profile import ServerProfile

ATTN_DP_FLAG = "--attn-dp-size"

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


class SGLang(Engine):
    name = "sglang"
    module = "sglang.launch_server"
    default_port = 30000
    # 0.5.23 answers `return_token_ids` with HTTP 400 when streaming; these put the ids in
    # one chunk with empty `choices` and `sglext.input_ids` / `sglext.output_ids[choice]`.
    # Releases without them (0.5.9) drop unknown fields: the ids then just do not come.
    token_id_fields: ClassVar[Mapping[str, Any]] = {
        "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}

    def flags(self, profile: ServerProfile, port: int,
              install: EngineInstall | None = None) -> list[str]:
        args = common_flags(profile, port, model_flag="--model-path")
        args += ["--tp-size", str(profile.tp)]
        if profile.dp_attention and uses_attn_dp_size(install):
            args += ["--attn-dp-size", str(profile.dp)]
        elif profile.dp_attention:
            args += ["--dp-size", str(profile.dp), "--enable-dp-attention"]
        elif profile.dp > 1:
            args += ["--dp-size", str(profile.dp)]
        if profile.deterministic_inference:
            args.append("--enable-deterministic-inference")
        if profile.mem_fraction is not None:
            args += ["--mem-fraction-static", f"{profile.mem_fraction:g}"]
        if profile.hierarchical_cache.enabled:
            args.append("--enable-hierarchical-cache")
            if profile.hierarchical_cache.host_gb_per_rank is not None:
                args += ["--hicache-size", str(profile.hierarchical_cache.host_gb_per_rank)]
        args += ["--kv-cache-dtype", kv_dtype_arg(profile.kv_cache_dtype)]
        if profile.model_dtype:
            args += ["--dtype", profile.model_dtype]
        if profile.reasoning_parser:
            args += ["--reasoning-parser", profile.reasoning_parser]
        if profile.max_running_requests is not None:
            args += ["--max-running-requests", str(profile.max_running_requests)]
        if profile.context_length is not None:
            args += ["--context-length", str(profile.context_length)]
        # /metrics exists only with this flag; draftgen's load view reads it.
        args.append("--enable-metrics")
        return args

    async def read_info(
        self, session: aiohttp.ClientSession, url: str, *, profile: ServerProfile | None = None
    ) -> ServerInfo | None:
        data = await get_json(session, f"{url}/server_info")
        if data is None:
            data = await get_json(session, f"{url}/get_server_info")
        if not isinstance(data, dict) or not is_sglang_server_info(data):
            return None
        try:
            loads = await get_json(session, f"{url}/v1/loads")
            models = await get_json(session, f"{url}/v1/models")
        except ServerInfoError:
            # Capacity is in server_info already; these only sharpen it.
            loads = models = None
        return parse_server_info(url, data, loads, models)


def uses_attn_dp_size(install: EngineInstall | None) -> bool:
    """`--attn-dp-size` where the installed SGLang defines it (0.5.23 deprecates
    `--enable-dp-attention`, whose removal is announced); unknown: the newest release's."""
    known = install.has_flag(ATTN_DP_FLAG) if install is not None else None
    return True if known is None else known


def kv_dtype_arg(dtype: str) -> str:
    """SGLang's spelling: every 0.4/0.5 release accepts `bf16`, only newer ones `bfloat16`."""
    return "bf16" if dtype == "bfloat16" else dtype


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

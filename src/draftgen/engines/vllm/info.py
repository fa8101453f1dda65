"""vLLM's settings read back into a `ServerInfo`.

vLLM has no server-info endpoint; its capacity and KV dtype are labels of the gauge
`vllm:cache_config_info` on `/metrics` (one sample per data-parallel engine), its version is
`/version`, and the served model and context length are in `/v1/models`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from draftgen.engines.common import (
    as_float,
    as_int,
    as_str,
    model_max_len,
    resolve_auto_kv_dtype,
)
from draftgen.engines.dtypes import AUTO, canonical_kv_dtype
from draftgen.engines.info import ServerInfo, WorkerFacts

if TYPE_CHECKING:
    from draftgen.engines.spec import LaunchSpec

CACHE_INFO = "vllm:cache_config_info"

# cache_config_info labels recorded with the info.
RECORDED_LABELS = (
    "cache_dtype", "block_size", "num_gpu_blocks", "num_gpu_blocks_override",
    "kv_cache_size_tokens", "kv_cache_memory_bytes", "gpu_memory_utilization",
    "enable_prefix_caching", "kv_cache_max_concurrency", "kv_offloading_backend",
    "kv_offloading_size", "num_cpu_blocks", "sliding_window",
)  # fmt: skip


def cache_config_labels(metrics: str) -> list[dict[str, str]]:
    """The labels of every `vllm:cache_config_info` sample, ordered by engine index."""
    samples: list[dict[str, str]] = []
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == CACHE_INFO:
                samples.append(dict(sample.labels))
    return sorted(samples, key=lambda labels: as_int(labels.get("engine")) or 0)


def engine_kv_tokens(labels: Mapping[str, str]) -> int | None:
    tokens = as_int(labels.get("kv_cache_size_tokens"))
    if tokens is not None:
        return tokens
    # Older releases have only blocks: capacity is blocks × tokens per block.
    blocks, block_size = as_int(labels.get("num_gpu_blocks")), as_int(labels.get("block_size"))
    return blocks * block_size if blocks is not None and block_size is not None else None


def parse_info(
    url: str,
    metrics: str,
    *,
    version: Any = None,
    models: Any = None,
    profile: LaunchSpec | None = None,
) -> ServerInfo:
    engines = cache_config_labels(metrics)
    first = engines[0] if engines else {}
    model = root = None
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model, root = as_str(data[0].get("id")), as_str(data[0].get("root"))
    setting = first.get("cache_dtype")
    if setting is None:
        kv_dtype, note = None, f"{CACHE_INFO} has no cache_dtype label"
    elif canonical_kv_dtype(setting) == AUTO:
        # On vLLM `auto` is the model's dtype; the server does not say which that is.
        hint = profile.model_dtype if profile is not None else None
        kv_dtype, note = resolve_auto_kv_dtype(
            root or (profile.model_path if profile is not None else None), hint
        )
        if hint and kv_dtype == hint:
            note = f"auto → the model dtype {hint} (the launch profile's model_dtype)"
    else:
        kv_dtype, note = setting, f"{CACHE_INFO} cache_dtype"
    ranks = tuple(t for t in (engine_kv_tokens(e) for e in engines) if t is not None)
    return ServerInfo(
        url=url,
        engine="vllm",
        version=as_str(version),
        model=model,
        model_path=root,
        kv_dtype=canonical_kv_dtype(kv_dtype) if kv_dtype else None,
        kv_dtype_setting=setting,
        kv_dtype_note=note,
        kv_tokens=sum(ranks) if ranks else None,
        kv_tokens_per_rank=ranks,
        # vLLM does not publish max_num_seqs; the launch profile's value is only a request.
        max_running_requests=None,
        mem_fraction=as_float(first.get("gpu_memory_utilization")),
        context_length=model_max_len(models),
        tp=None,
        dp=len(engines) or None,
        seeds_honoured=True,
        args={k: first[k] for k in RECORDED_LABELS if k in first},
    )


def parse_gateway_info(url: str, metrics: str, facts: WorkerFacts, *,
                       profile: LaunchSpec | None = None) -> ServerInfo | None:
    """A worker's settings from its `/metrics` as a gateway relays them, with what the
    gateway says of it in place of its `/version` and `/v1/models`. None without a
    `vllm:cache_config_info` to read."""
    if not cache_config_labels(metrics):
        return None
    model = {"id": facts.served_name, "root": facts.model_path,
             "max_model_len": facts.context_length}
    return parse_info(url, metrics, version=facts.version, models={"data": [model]},
                      profile=profile)

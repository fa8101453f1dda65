"""vLLM's load: Prometheus `/metrics` (always on), one series per data-parallel engine."""

from __future__ import annotations

from draftgen.engines.load import MetricNames
from draftgen.engines.vllm.info import CACHE_INFO

METRICS = MetricNames(
    engine="vllm",
    prefix="vllm:",
    sums={
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_preemptions_total": "preemptions_total",
        "vllm:generation_tokens_total": "generation_tokens_total",
        "vllm:iteration_tokens_total_count": "engine_steps_total",
    },
    usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    capacity_info=CACHE_INFO,
)

"""The tune's levers as vLLM spells them.

    chunked_prefill   --max-num-batched-tokens N
    prefix_cache      --enable-prefix-caching / --no-enable-prefix-caching (on by default)
    speculative       --speculative-config JSON
    cpu_kv_gib        env VLLM_CPU_KVCACHE_SPACE (the CPU build's KV cache, GiB)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from draftgen.engines.common import drop_flag

if TYPE_CHECKING:
    from draftgen.engines.spec import DraftSpec

CHUNK_FLAG = "--max-num-batched-tokens"
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
PREFIX_ON, PREFIX_OFF = "--enable-prefix-caching", "--no-enable-prefix-caching"
SPECULATIVE_FLAGS = ("--speculative-config",)


def prefix_cache_on(args: Sequence[str]) -> bool:
    on = off = -1
    for i, a in enumerate(args):
        if a == PREFIX_ON:
            on = i
        elif a == PREFIX_OFF:
            off = i
    return off < on or off == -1


def with_prefix_cache(args: Sequence[str], on: bool) -> list[str]:
    kept = drop_flag(drop_flag(args, PREFIX_ON, valued=False), PREFIX_OFF, valued=False)
    return [*kept, PREFIX_ON if on else PREFIX_OFF]


def speculative_args(spec: DraftSpec) -> list[str]:
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_tokens}
    if spec.draft_model:
        config["model"] = spec.draft_model
    if spec.method == "ngram":
        # vLLM needs the n-gram window for prompt lookup; these are its documented examples.
        config.update(prompt_lookup_max=4, prompt_lookup_min=2)
    return ["--speculative-config", json.dumps(config, separators=(",", ":"))]

"""The quality policy: no lossy KV cache unless a profile says so in writing.

Training data inherits every error of the server that wrote it. A quantized KV cache
(fp8, fp4, int8, …) roughly doubles capacity but measurably degrades the model, and `auto`
may pick fp8 silently when a checkpoint declares an fp8 KV scheme. So draftgen refuses both
before launch (`check_profile`), checks the dtype a running server really uses
(`check_running`), and the one override — `quality: {allow_lossy_kv_cache: true}` in the
profile — comes back as a stamp for every run manifest that uses the server.
"""

from __future__ import annotations

from typing import Any

from draftgen.engines.dtypes import (
    AUTO,
    LOSSLESS_KV_DTYPES,
    canonical_kv_dtype,
    is_known_lossy,
    is_lossy_kv_dtype,
)
from draftgen.engines.info import ServerInfo
from draftgen.errors import DraftgenError
from draftgen.servers.profile import ServerProfile, profile_hash


class QualityPolicyError(DraftgenError):
    """A profile or a running server would produce data from a lossy KV cache."""


EVIDENCE = (
    "Why: a quantized KV cache perturbs every token the model attends to, and the damage is "
    "measured:\n"
    "  - DeepSeek-R1 AIME25 0.507 → 0.493 and Qwen3-235B 0.773 → 0.733 with an fp8 KV cache "
    "(SGLang docs, quantized KV cache table)\n"
    "  - GLM-5.1 AIME 95.3 → 76.7 with an fp8 KV cache (sgl-project/sglang#22671)\n"
    "  - garbage multi-turn output from an MLA model with an fp8 KV cache "
    "(vllm-project/vllm#38652)\n"
    "Training data inherits that loss, and nothing downstream can detect it."
)

LEVERS = (
    "Lossless ways to more KV capacity or throughput:\n"
    "  - mem_fraction (--mem-fraction-static / --gpu-memory-utilization): raise it while "
    "`serve` reports headroom per GPU\n"
    "  - dp + dp_attention on MLA models (Kimi-K2.5, DeepSeek-V3): removes the copy of the "
    "latent KV that plain TP keeps on every GPU\n"
    "  - max_running_requests: cap concurrency so running requests fit the KV pool instead "
    "of being retracted and re-prefilled\n"
    "  - hierarchical_cache: keeps evicted prefixes in host RAM (helps shared prompts; it does "
    "not hold running requests)"
)

OVERRIDE = (
    "To accept the loss anyway, name the lossy dtype and add to the profile:\n"
    "  quality: {allow_lossy_kv_cache: true, reason: \"...\"}\n"
    "The override is stamped into the manifest of every run that uses the server."
)


def _refusal(what: str, extra: str = "") -> QualityPolicyError:
    parts = [what, *([extra] if extra else []), EVIDENCE, LEVERS, OVERRIDE]
    return QualityPolicyError("\n\n".join(parts))


def _where(profile: ServerProfile) -> str:
    return f"{profile.source_file}: " if profile.source_file else ""


def check_profile(profile: ServerProfile) -> dict[str, Any] | None:
    """Refuse a profile whose KV dtype is lossy (unless overridden) or `auto` (always).

    Returns None for a lossless profile, or the override stamp for a run manifest.
    """
    dtype = canonical_kv_dtype(profile.kv_cache_dtype)
    if dtype == AUTO:
        # Even with the override: accepting a loss means naming it, not letting the engine pick.
        raise _refusal(
            f"{_where(profile)}kv_cache_dtype: 'auto' is refused: the engine picks the KV dtype, "
            "and it picks fp8 when the checkpoint declares an fp8 KV scheme, without a word.",
            "Name the dtype: `kv_cache_dtype: bfloat16` (the default) stores the KV cache "
            "losslessly for bf16 models.",
        )
    if not is_lossy_kv_dtype(dtype):
        return None
    if profile.quality.allow_lossy_kv_cache:
        return quality_stamp(profile, dtype)
    kind = "a lossy (quantized)" if is_known_lossy(dtype) else "not a full-precision"
    raise _refusal(
        f"{_where(profile)}kv_cache_dtype: {dtype!r} is {kind} KV cache dtype; draftgen refuses "
        f"it by default (allowed: {', '.join(sorted(LOSSLESS_KV_DTYPES))})."
    )


def check_running(info: ServerInfo, profile: ServerProfile | None = None) -> dict[str, Any] | None:
    """Check the dtype a running server really uses; raise on a policy violation.

    `profile` is the profile the server was launched from, if any: only its override can
    allow a lossy cache. A dtype that cannot be determined is a violation too, since the
    point is to know. Returns the override stamp, or None when the cache is lossless.
    """
    if info.kv_dtype is None:
        raise QualityPolicyError(
            f"policy violation: cannot tell which KV cache dtype {info.url} ({info.engine}) "
            f"uses: {info.kv_dtype_note or 'not reported'}. Launch it with an explicit "
            "--kv-cache-dtype (a draftgen profile does), or run draftgen where the model "
            "folder is readable."
        )
    dtype = canonical_kv_dtype(info.kv_dtype)
    if not is_lossy_kv_dtype(dtype):
        return None
    if profile is not None and profile.quality.allow_lossy_kv_cache:
        return quality_stamp(profile, dtype, info)
    raise _refusal(
        f"policy violation: {info.url} ({info.engine}) runs a lossy KV cache: {dtype} "
        f"({info.kv_dtype_note}). draftgen will not record data from it."
    )


def quality_stamp(
    profile: ServerProfile, dtype: str, info: ServerInfo | None = None
) -> dict[str, Any]:
    """What a run manifest records when a profile's override let a lossy KV cache through."""
    return {
        "allow_lossy_kv_cache": True,
        "kv_cache_dtype": dtype,
        "reason": profile.quality.reason,
        "profile": str(profile.source_file) if profile.source_file else None,
        "profile_hash": profile_hash(profile),
        "server": info.url if info is not None else None,
        "warning": "lossy KV cache: outputs may differ from the full-precision model",
    }

"""A profile's `tune:` section: which settings `draftgen tune` may try, and the draft model
for speculative decoding.

Each lever is a list of values to try, one candidate per value (the other levers as the
profile has them). Unset, draftgen picks a small default for the lever (`tune/candidates.py`);
`[]` leaves it alone. `candidates` replaces the grid with exact combinations. The section is
not a server setting: `profile_hash` leaves it out, and a launch ignores it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftgen.engines.dtypes import canonical_kv_dtype


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Speculative(_Strict):
    """Speculative decoding: the draft proposes, the target verifies every token, so the
    output distribution is the target's (lossless; the probe still checks the engine)."""

    # SGLang --speculative-algorithm (EAGLE, EAGLE3, NEXTN, NGRAM); vLLM speculative_config
    # method (eagle, eagle3, draft_model, mtp, ngram). Spelled as the engine spells it.
    method: str = Field(min_length=1)
    # The draft's weights (a folder or hub id); not needed by ngram or NEXTN/MTP.
    draft_model: str | None = None
    # Tokens proposed per step (vLLM num_speculative_tokens, SGLang num_draft_tokens).
    num_tokens: int = Field(default=4, ge=1)
    # SGLang's draft depth and branching (--speculative-num-steps, --speculative-eagle-topk).
    num_steps: int | None = Field(default=None, ge=1)
    eagle_topk: int | None = Field(default=None, ge=1)


class Levers(_Strict):
    """One candidate: what it changes from the reference profile (unset: as the profile)."""

    # KV memory: --mem-fraction-static / --gpu-memory-utilization.
    mem_fraction: float | None = Field(default=None, gt=0, le=1)
    # The server's running-request limit: --max-running-requests / --max-num-seqs.
    max_running_requests: int | None = Field(default=None, ge=1)
    # Prefill chunk: SGLang --chunked-prefill-size, vLLM --max-num-batched-tokens.
    chunked_prefill: int | None = Field(default=None, ge=1)
    # SGLang's radix cache / vLLM's prefix caching.
    prefix_cache: bool | None = None
    # SGLang HiCache host pool per rank in decimal GB; 0 turns HiCache off.
    hicache_gb_per_rank: int | None = Field(default=None, ge=0)
    # SGLang data-parallel attention over the TP group (MLA models).
    dp_attention: bool | None = None
    # Decode context parallelism over this many GPUs of the attention TP group (MLA models:
    # up to dcp× the KV tokens). It replaces DP attention where the reference has it on.
    dcp: int | None = Field(default=None, ge=1)
    # The profile's `tune.speculative` draft on (true) or off.
    speculative: bool | None = None
    # Speculative decoding that adapts its draft length to the batch (SGLang
    # --speculative-adaptive, where the release has it); with the draft on.
    speculative_adaptive: bool | None = None
    # Lossy values (fp8, fp4, ...) are tried only where the profile's quality override
    # allows them, and must pass the probe like any other candidate.
    kv_cache_dtype: str | None = None
    # The compute dtype (--dtype), e.g. float32.
    model_dtype: str | None = None
    # Other weights for the same model (a quantised copy, say): a folder or hub id, a
    # relative folder taken from the profile's. Listed candidates only; the probe judges it.
    model_path: str | None = Field(default=None, min_length=1)
    # vLLM's CPU build: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_gib: int | None = Field(default=None, ge=1)

    @field_validator("kv_cache_dtype")
    @classmethod
    def _canonical(cls, v: str | None) -> str | None:
        return None if v is None else canonical_kv_dtype(v)

    def changes(self) -> dict[str, object]:
        """The levers this candidate sets, in field order."""
        return self.model_dump(exclude_none=True)


class TuneSpace(_Strict):
    """Values to try per lever (unset: draftgen's default for this engine; []: none)."""

    mem_fraction: list[float] | None = None
    max_running_requests: list[int] | None = None
    chunked_prefill: list[int] | None = None
    prefix_cache: list[bool] | None = None
    hicache_gb_per_rank: list[int] | None = None
    dp_attention: list[bool] | None = None
    dcp: list[int] | None = None
    speculative_adaptive: list[bool] | None = None
    kv_cache_dtype: list[str] | None = None
    model_dtype: list[str] | None = None
    cpu_kv_gib: list[int] | None = None
    # The draft model; with it the grid tries speculative decoding on.
    speculative: Speculative | None = None
    # Exact candidates instead of the grid (the reference is always measured too).
    candidates: list[Levers] | None = None
    # After the first measurements, also try the best value of every lever that helped,
    # together.
    combine: bool = True

    @field_validator("mem_fraction")
    @classmethod
    def _fractions(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(not 0 < x <= 1 for x in v):
            raise ValueError("each mem_fraction must be in (0, 1]")
        return v

    @field_validator("max_running_requests", "chunked_prefill", "cpu_kv_gib", "dcp")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(x < 1 for x in v):
            raise ValueError("each value must be at least 1")
        return v

    @field_validator("hicache_gb_per_rank")
    @classmethod
    def _sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(x < 0 for x in v):
            raise ValueError("each size must be >= 0 (0: HiCache off)")
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _dtypes(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [canonical_kv_dtype(x) for x in v]

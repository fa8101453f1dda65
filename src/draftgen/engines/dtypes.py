"""KV cache dtype names: one spelling per dtype, and which ones lose information.

Engines spell the same dtype differently (`bf16`, `bfloat16`); everything inside draftgen uses
the canonical name. Anything that is not a known full-precision float counts as lossy, so a
quantized format added to an engine next month is refused until someone looks at it.
"""

from __future__ import annotations

_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}

LOSSLESS_KV_DTYPES = frozenset({"bfloat16", "float16", "float32"})

# Families seen in SGLang and vLLM (fp8, fp8_e4m3, fp8_e5m2, fp8_inc, fp8_ds_mla, fp4_e2m1,
# mxfp8, nvfp4, nvfp4_ds_mla, int8_per_token_head, turboquant_*, …), matched by prefix; they
# only sharpen the refusal message, since every unknown name is refused anyway.
LOSSY_KV_PREFIXES = (
    "fp8", "fp6", "fp4", "mxfp", "nvfp", "int8", "int4", "int2", "uint8", "q8", "q4",
    "turboquant", "ultraquant", "tq", "rq", "e4m3", "e5m2",
)  # fmt: skip

AUTO = "auto"


def canonical_kv_dtype(name: str) -> str:
    n = name.strip().lower().replace("-", "_")
    return _ALIASES.get(n, n)


def is_lossy_kv_dtype(name: str) -> bool:
    """True for every dtype that is not a full-precision float; `auto` is neither (see policy)."""
    n = canonical_kv_dtype(name)
    return n != AUTO and n not in LOSSLESS_KV_DTYPES


def is_known_lossy(name: str) -> bool:
    return canonical_kv_dtype(name).startswith(LOSSY_KV_PREFIXES)


def short_kv_dtype(name: str) -> str:
    """The short form people read in a summary line: bf16, fp16, fp8_e4m3."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        canonical_kv_dtype(name), canonical_kv_dtype(name)
    )

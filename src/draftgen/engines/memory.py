"""How many KV tokens a profile will hold, before a GPU exists: the memory model.

Per GPU, an engine sizes its KV pool as what its memory fraction leaves after the weights:

    kv_bytes_per_gpu = gpu_memory × fraction − weights_per_gpu − reserve

(SGLang: `rest_memory = available_after_load − memory_before_load × (1 − mem_fraction_static)`,
`mem_cache/kv_cache_configurator.py` of 0.5.23; vLLM: `gpu_memory_utilization` × memory −
weights − the profiled activation peak). `reserve` is the one unknown (activations, graphs,
the engine's buffers): fitted from a measured point when there is one, else the engine's
default, and its source is always said.

Tokens per pool follow from the bytes one token costs on one GPU (SGLang's `cell_size`):

- MLA (DeepSeek-V3, Kimi-K2): the compressed latent plus the rope key, `kv_lora_rank +
  qk_rope_head_dim` elements a layer — one "head" that tensor parallelism cannot split, so
  every GPU of a TP group holds a whole copy;
- GQA/MHA: keys and values of the KV heads, split over the attention TP group up to their
  count (replicated beyond it);
- decode context parallelism (`dcp`) shards the tokens of a pool over `dcp` GPUs;
- DP attention gives each of its ranks a pool of its own (tokens add up over ranks) but
  replicates the attention weights on every rank, which the weights per GPU pay for.

Weights per GPU: the checkpoint's bytes / tp, plus what TP does not shard (MLA's low-rank
down-projections), plus under DP attention the attention weights no longer sharded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.engines.dtypes import canonical_kv_dtype

GB = 10**9
MIB = 1024**2
# Attention stays 16-bit in weight-only quantised checkpoints (INT4 experts, bf16 attention).
ATTENTION_BYTES_PER_PARAM = 2


class MemoryModelError(ValueError):
    """The model's shape or the memory facts are missing or make no sense."""


def kv_dtype_bytes(dtype: str, model_dtype_bytes: float = 2.0) -> float:
    """Bytes per KV element (`auto`: the model's dtype)."""
    name = canonical_kv_dtype(dtype)
    if name == "auto":
        return model_dtype_bytes
    if name == "float32":
        return 4.0
    if name in ("bfloat16", "float16"):
        return 2.0
    if "4" in name.split("_")[0] or name.startswith(("nvfp4", "mxfp4", "fp4", "int4")):
        return 0.5
    return 1.0  # fp8 variants, int8


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a model's config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    # MLA (None for GQA/MHA).
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    source: str = ""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "") -> ModelShape:
        text = config.get("text_config")
        c = text if isinstance(text, dict) else config
        try:
            layers, hidden = int(c["num_hidden_layers"]), int(c["hidden_size"])
            heads = int(c["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as e:
            raise MemoryModelError(f"{source or 'config.json'}: no {e} in the model config"
                                   ) from None
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        if c.get("kv_lora_rank"):
            return cls(layers, hidden, heads, kv_heads, head_dim,
                       kv_lora_rank=int(c["kv_lora_rank"]),
                       qk_rope_head_dim=int(c.get("qk_rope_head_dim") or 0),
                       qk_nope_head_dim=int(c.get("qk_nope_head_dim") or 0),
                       v_head_dim=int(c.get("v_head_dim") or 0),
                       q_lora_rank=int(c["q_lora_rank"]) if c.get("q_lora_rank") else None,
                       source=source)
        return cls(layers, hidden, heads, kv_heads, head_dim, source=source)

    @classmethod
    def read(cls, path: Path) -> ModelShape:
        """From a config.json, or a model folder holding one."""
        file = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise MemoryModelError(f"{file}: cannot read the model config ({e})") from None
        if not isinstance(config, dict):
            raise MemoryModelError(f"{file}: the model config is not a JSON object")
        return cls.from_config(config, str(file))

    def kv_elements(self, attn_tp: int) -> float:
        """KV elements one token costs on one GPU of an attention TP group of `attn_tp`."""
        if self.mla:
            assert self.kv_lora_rank is not None
            return float(self.layers * (self.kv_lora_rank + self.qk_rope_head_dim))
        heads_here = max(1.0, self.kv_heads / attn_tp)
        return float(self.layers * 2 * heads_here * self.head_dim)

    def attention_params(self) -> tuple[int, int]:
        """Attention parameters over all layers: (sharded by TP, replicated under TP)."""
        h, n = self.hidden, self.heads
        if self.mla:
            assert self.kv_lora_rank is not None
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            if self.q_lora_rank:
                replicated = h * self.q_lora_rank + kv_a
                q = self.q_lora_rank * n * qk
            else:
                replicated, q = kv_a, h * n * qk
            sharded = (q + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
                       + n * self.v_head_dim * h)
        else:
            replicated = 0
            sharded = 2 * h * n * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        return sharded * self.layers, replicated * self.layers


@dataclass(frozen=True)
class Layout:
    """How a server places the model on its GPUs."""

    tp: int = 1
    dp: int = 1  # replicas, each a TP group of its own GPUs
    attn_dp: int = 1  # DP-attention ranks inside one TP group
    dcp: int = 1  # decode context parallelism: a pool's tokens sharded over this many GPUs

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.attn_dp, self.dcp) < 1:
            raise MemoryModelError("tp, dp, attn_dp and dcp must be at least 1")
        if self.tp % self.attn_dp:
            raise MemoryModelError(f"attn_dp {self.attn_dp} must divide tp {self.tp}")
        if (self.tp // self.attn_dp) % self.dcp:
            raise MemoryModelError(
                f"dcp {self.dcp} must divide the attention TP group ({self.tp // self.attn_dp})")

    @property
    def attn_tp(self) -> int:
        return self.tp // self.attn_dp

    @property
    def pools(self) -> int:
        """KV pools over the server: one per DP-attention rank per replica."""
        return self.dp * self.attn_dp

    def describe(self) -> str:
        parts = [f"tp {self.tp}"]
        if self.dp > 1:
            parts.append(f"dp {self.dp}")
        if self.attn_dp > 1:
            parts.append(f"DP attention {self.attn_dp}")
        if self.dcp > 1:
            parts.append(f"dcp {self.dcp}")
        return ", ".join(parts)


@dataclass(frozen=True)
class MeasuredPoint:
    """A KV capacity a server really reported, and what it ran with."""

    kv_tokens: int
    fraction: float
    kv_cache_dtype: str
    layout: Layout
    source: str


@dataclass(frozen=True)
class Hardware:
    gpu_bytes: float  # one GPU's memory (the driver's total, or the profile's figure)
    weights_bytes: float  # the checkpoint, all of it
    gpu_source: str
    weights_source: str


@dataclass(frozen=True)
class Prediction:
    kv_tokens: int  # over the whole server
    tokens_per_pool: int
    kv_bytes_per_gpu: float
    weights_bytes_per_gpu: float
    bytes_per_token_per_gpu: float
    reserve_bytes: float
    reserve_source: str
    layout: Layout

    def describe(self) -> str:
        return (f"{self.kv_tokens:,} KV tokens ({self.layout.describe()}; "
                f"{self.layout.pools} pool(s) of {self.tokens_per_pool:,}; per GPU "
                f"{self.weights_bytes_per_gpu / GB:.1f} GB weights, "
                f"{self.kv_bytes_per_gpu / GB:.2f} GB KV at "
                f"{self.bytes_per_token_per_gpu:,.0f} B/token)")


def weights_per_gpu(shape: ModelShape, layout: Layout, weights_bytes: float) -> float:
    """The checkpoint's share of one GPU: sharded by TP, plus what TP keeps whole (MLA's
    down-projections) and, under DP attention, the attention weights each rank holds whole."""
    sharded, replicated = (p * ATTENTION_BYTES_PER_PARAM for p in shape.attention_params())
    tp = layout.tp
    return (weights_bytes / tp + replicated * (1 - 1 / tp)
            + sharded * (1 / layout.attn_tp - 1 / tp))


def bytes_per_token(shape: ModelShape, layout: Layout, kv_cache_dtype: str) -> float:
    """KV bytes one token costs on one GPU of its pool."""
    return shape.kv_elements(layout.attn_tp) * kv_dtype_bytes(kv_cache_dtype) / layout.dcp


def fit_reserve(shape: ModelShape, hw: Hardware, point: MeasuredPoint) -> float:
    """The reserve that makes the model give the measured capacity."""
    per_pool = point.kv_tokens / point.layout.pools
    kv = per_pool * bytes_per_token(shape, point.layout, point.kv_cache_dtype)
    return (hw.gpu_bytes * point.fraction
            - weights_per_gpu(shape, point.layout, hw.weights_bytes) - kv)


def predict(shape: ModelShape, hw: Hardware, layout: Layout, fraction: float,
            kv_cache_dtype: str, *, reserve_bytes: float, reserve_source: str) -> Prediction:
    weights = weights_per_gpu(shape, layout, hw.weights_bytes)
    kv = hw.gpu_bytes * fraction - weights - reserve_bytes
    per_token = bytes_per_token(shape, layout, kv_cache_dtype)
    per_pool = max(0, int(kv // per_token)) if kv > 0 else 0
    return Prediction(per_pool * layout.pools, per_pool, max(kv, 0.0), weights, per_token,
                      reserve_bytes, reserve_source, layout)

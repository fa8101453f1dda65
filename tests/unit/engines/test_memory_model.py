"""The memory model against the Kimi case's own numbers (DEVELOPERS.md, shared/notes/kimi.md).

The team measured, on 8 × RTX PRO 6000 Blackwell (nvidia-smi: 97,887 MiB each), SGLang TP 8,
Kimi-K2.5 INT4: 159,277 KV tokens in bf16 at --mem-fraction-static 0.88, ~116K at 0.85 (the
original baseline), and ~376K in fp8_e4m3 at 0.90. Calibrated on the first, the model must
give the other two within 5%; from the checkpoint's published size alone (595 GB, the INT4
release) it lands 28% high, and the fitted reserve says why (see the last test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from draftgen.engines.memory import (
    ATTENTION_BYTES_PER_PARAM,
    GB,
    MIB,
    Hardware,
    Layout,
    MeasuredPoint,
    MemoryModelError,
    ModelShape,
    bytes_per_token,
    fit_reserve,
    kv_dtype_bytes,
    predict,
    weights_per_gpu,
)

REPO = Path(__file__).resolve().parents[3]
KIMI = ModelShape.read(REPO / "examples" / "models" / "kimi-k2.5")
HW = Hardware(97_887 * MIB, 595e9, "nvidia-smi of the case", "595 GB, the INT4 release")
TP8 = Layout(tp=8)
MEASURED = MeasuredPoint(159_277, 0.88, "bfloat16", TP8, "the Kimi case, bf16 at 0.88")
RESERVE = fit_reserve(KIMI, HW, MEASURED)


def tokens(layout: Layout, fraction: float, dtype: str, reserve: float = RESERVE) -> int:
    return predict(KIMI, HW, layout, fraction, dtype, reserve_bytes=reserve,
                   reserve_source="test").kv_tokens


def test_the_kimi_latent_costs_what_mla_stores() -> None:
    assert KIMI.mla and KIMI.layers == 61
    # (512 latent + 64 rope) × 61 layers × 2 bytes, whole on every GPU of the TP group.
    assert bytes_per_token(KIMI, TP8, "bfloat16") == 576 * 61 * 2
    assert bytes_per_token(KIMI, TP8, "fp8_e4m3") == 576 * 61
    assert bytes_per_token(KIMI, Layout(tp=8, dcp=8), "bfloat16") == 576 * 61 * 2 / 8


def test_calibrated_on_bf16_it_reproduces_the_measured_capacities() -> None:
    assert tokens(TP8, 0.88, "bfloat16") == pytest.approx(159_277, abs=1)
    fp8 = tokens(TP8, 0.90, "fp8_e4m3")
    assert fp8 == pytest.approx(376_000, rel=0.05), fp8
    baseline = tokens(TP8, 0.85, "bfloat16")
    assert baseline == pytest.approx(116_000, rel=0.05), baseline


def test_what_it_predicts_for_the_lossless_levers() -> None:
    bf16_88 = tokens(TP8, 0.88, "bfloat16")
    # Decode context parallelism shards the latent: the same bytes hold 8× the tokens.
    assert tokens(Layout(tp=8, dcp=8), 0.88, "bfloat16") == pytest.approx(8 * bf16_88, rel=1e-4)
    # More memory fraction: every 0.01 is 1% of the GPU, all of it KV.
    per_point = 0.01 * HW.gpu_bytes / bytes_per_token(KIMI, TP8, "bfloat16")
    assert tokens(TP8, 0.90, "bfloat16") == pytest.approx(bf16_88 + 2 * per_point, rel=1e-3)
    assert tokens(TP8, 0.92, "bfloat16") == pytest.approx(bf16_88 + 4 * per_point, rel=1e-3)
    # DP attention 8: each rank holds the attention weights whole (7/8 more of them per GPU),
    # and has a pool of its own; it fits next to the INT4 experts, with far less KV per GPU.
    sharded, _ = KIMI.attention_params()
    extra = sharded * ATTENTION_BYTES_PER_PARAM * 7 / 8
    dpa = Layout(tp=8, attn_dp=8)
    assert weights_per_gpu(KIMI, dpa, HW.weights_bytes) == pytest.approx(
        weights_per_gpu(KIMI, TP8, HW.weights_bytes) + extra)
    prediction = predict(KIMI, HW, dpa, 0.88, "bfloat16", reserve_bytes=RESERVE,
                         reserve_source="test")
    assert 0 < prediction.kv_bytes_per_gpu < 0.25 * 11.2 * GB
    assert prediction.tokens_per_pool * 8 == prediction.kv_tokens
    assert bf16_88 < prediction.kv_tokens < 2 * bf16_88


def test_from_the_checkpoint_size_alone_it_lands_high_by_the_fitted_reserve() -> None:
    unfitted = tokens(TP8, 0.88, "bfloat16", reserve=0.0)
    # 28% over: SGLang's static fraction holds more than weights and KV (the CUDA context and
    # communication buffers inside its pre-load measure, the vision encoder held whole on
    # every rank, the request-to-token table, kernel workspaces): 3.1 GB a GPU, which the
    # one measured point supplies.
    assert 1.15 < unfitted / 159_277 < 1.35
    assert 2.5 * GB < RESERVE < 3.8 * GB


def test_gqa_heads_split_up_to_their_count() -> None:
    shape = ModelShape.from_config({"num_hidden_layers": 32, "hidden_size": 4096,
                                    "num_attention_heads": 32, "num_key_value_heads": 8})
    assert not shape.mla and shape.head_dim == 128
    full = bytes_per_token(shape, Layout(tp=1), "bfloat16")
    assert full == 32 * 2 * 8 * 128 * 2
    assert bytes_per_token(shape, Layout(tp=4), "bfloat16") == full / 4
    # Beyond 8 GPUs a KV head is replicated, not split further.
    assert bytes_per_token(shape, Layout(tp=16), "bfloat16") == full / 8


@pytest.mark.parametrize("dtype, size", [("bfloat16", 2), ("fp8_e4m3", 1), ("fp8", 1),
                                         ("float32", 4), ("nvfp4", 0.5), ("auto", 2)])
def test_kv_dtype_sizes(dtype: str, size: float) -> None:
    assert kv_dtype_bytes(dtype) == size


def test_layouts_that_cannot_be_are_refused() -> None:
    with pytest.raises(MemoryModelError, match="dcp 3"):
        Layout(tp=8, dcp=3)
    with pytest.raises(MemoryModelError, match="attn_dp 3"):
        Layout(tp=8, attn_dp=3)
    with pytest.raises(MemoryModelError, match="num_hidden_layers"):
        ModelShape.from_config({"hidden_size": 8}, "cfg.json")

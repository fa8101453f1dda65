"""The A/B probe on real local engines: no drift against itself, clear drift across dtypes.

The reference is the shared bf16 engine. The identical configuration is that engine probed
against itself (same weights, kernels and settings); the changed numerics are a second
engine that computes in float32. Kept small: the engines share two cores with other tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from draftgen.engine import LocalEngine
from draftgen.probe import ProbeResult, ProbeThresholds, load_prompts, run_probe

N_PROMPTS = 20
MAX_TOKENS = 32
TOP_K = 10


@pytest.fixture(scope="module")
def float32_engine(
    engine_installed: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalEngine]:
    log_path = tmp_path_factory.mktemp("engine-fp32") / "vllm.log"
    # The later --dtype wins over the launcher's bfloat16.
    engine = LocalEngine(tiny_model_dir, log_path=log_path, extra_args=["--dtype", "float32"])
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


async def probe(reference: str, candidate: str,
                thresholds: ProbeThresholds | None = None) -> ProbeResult:
    return await run_probe(
        reference, candidate, load_prompts(None), n=N_PROMPTS, max_tokens=MAX_TOKENS,
        top_k=TOP_K, model=None, thresholds=thresholds or ProbeThresholds(),
    )


async def test_identical_configuration_shows_no_divergence(local_engine: LocalEngine) -> None:
    result = await probe(local_engine.url, local_engine.url)
    assert result.engines == ("vllm", "vllm")
    assert len(result.details) == N_PROMPTS
    assert result.positions > N_PROMPTS * MAX_TOKENS // 2
    # Measured: exactly 0 and 100%. The slack only allows for batch-variant kernels, which
    # would let concurrent requests round differently.
    assert result.mean_kl <= 1e-9
    assert result.top1_agreement >= 0.99
    assert result.exact_match_rate >= 0.9
    assert result.passed


async def test_float32_candidate_shows_clearly_larger_divergence(
    local_engine: LocalEngine, float32_engine: LocalEngine
) -> None:
    same = await probe(local_engine.url, local_engine.url)
    strict = ProbeThresholds(max_mean_kl=1e-8, min_top1=0.999, min_exact_match=1.0)
    other = await probe(local_engine.url, float32_engine.url, strict)
    # The tiny random model's distributions are nearly flat, so absolute KLs are small;
    # what must hold is a gap no run-to-run noise explains, seen by every measure.
    assert other.mean_kl > 100 * max(same.mean_kl, 1e-9)
    assert other.max_kl > other.mean_kl > 0
    assert other.exact_match_rate < same.exact_match_rate
    assert other.mean_first_divergence is not None
    assert other.mean_matching_prefix < same.mean_matching_prefix
    # A strict verdict turns the drift into a failure, with its reasons.
    assert not other.passed
    assert any("mean KL" in f for f in other.failures)
    assert any("exact match" in f for f in other.failures)

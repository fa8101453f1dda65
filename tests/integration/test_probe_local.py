"""The A/B probe on real local engines: no drift against itself, clear drift across dtypes.

The reference is the shared bf16 engine. The identical configuration is that engine probed
against itself (same weights, kernels and settings); the changed numerics are a second
engine that computes in float32. Kept small: the engines share two cores with other tests.

No bound here is a constant tuned on one machine. Asked one request at a time, an engine
computes the same ids the same way every time (teacher-forced scoring never reads the prefix
cache), so against a recording of itself the probe must find exactly nothing: any drift there
is the probe's or a nondeterministic engine's. Asked as `draftgen probe` asks (several prompts
at once, both sides on the same engine), what shares a batch changes how vLLM's CPU kernels
round — on some CPUs and not others — and that noise, measured in the same test, is the floor
a real change must clear. Batch noise makes a rounding step differ at the few elements whose
float32 sum lies next to a bf16 rounding boundary; float32 compute changes every element's
rounding by a fraction of a bf16 step; so a real change of dtype must stand well clear of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from draftgen.local import LocalEngine
from draftgen.probe import ProbeResult, ProbeThresholds, load_prompts, run_probe
from draftgen.tune.referee import RecordedReference, probe_against, record_reference

N_PROMPTS = 20
MAX_TOKENS = 32
TOP_K = 10
# How far apart a change of compute dtype and the engine's batch noise must be (see the
# module docstring: a fraction of a rounding step at every element, against a whole step at
# a few; measured here ~200x).
CLEAR_OF_NOISE = 10


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


@pytest.fixture(scope="module")
def recorded(local_engine: LocalEngine) -> RecordedReference:
    """The reference's side of the probe, asked one request at a time."""
    return asyncio.run(record_reference(
        local_engine.url, load_prompts(None)[:N_PROMPTS], model=None, max_tokens=MAX_TOKENS,
        top_k=TOP_K, concurrency=1))


@pytest.fixture(scope="module")
def batched_self(local_engine: LocalEngine) -> ProbeResult:
    """The engine probed against itself as `draftgen probe` runs (several prompts at once):
    the batch noise both tests compare with, measured once."""
    return asyncio.run(probe(local_engine.url, local_engine.url))


async def probe(reference: str, candidate: str,
                thresholds: ProbeThresholds | None = None) -> ProbeResult:
    return await run_probe(
        reference, candidate, load_prompts(None), n=N_PROMPTS, max_tokens=MAX_TOKENS,
        top_k=TOP_K, model=None, thresholds=thresholds or ProbeThresholds(),
    )


async def alone(recorded: RecordedReference, candidate: str) -> ProbeResult:
    """The candidate against the recorded reference, one request at a time."""
    return await probe_against(recorded, candidate, thresholds=ProbeThresholds(),
                               concurrency=1)


async def test_identical_configuration_shows_no_divergence(
    local_engine: LocalEngine, recorded: RecordedReference, batched_self: ProbeResult
) -> None:
    # One request at a time, against its own recorded answers: the same bits, by
    # construction, at every position.
    same = await alone(recorded, local_engine.url)
    print(f"PROBE engine alone against its recording: {same.verdict_line()}")
    assert same.positions > N_PROMPTS * MAX_TOKENS // 2
    assert (same.mean_kl, same.max_kl, same.top1_agreement) == (0.0, 0.0, 1.0)
    assert same.passed

    # As `draftgen probe` runs: several prompts at once, both sides on this engine. What
    # differs from the above is only what shares a batch; it passes the default verdict.
    print(f"PROBE engine against itself, batched: {batched_self.verdict_line()}")
    assert batched_self.engines == ("vllm", "vllm")
    assert len(batched_self.details) == N_PROMPTS
    assert batched_self.positions > N_PROMPTS * MAX_TOKENS // 2
    assert batched_self.passed, batched_self.failures


async def test_float32_candidate_shows_clearly_larger_divergence(
    local_engine: LocalEngine, float32_engine: LocalEngine, recorded: RecordedReference,
    batched_self: ProbeResult
) -> None:
    # Noise-free on both sides (one request at a time, against the recording), where the
    # engine itself shows exactly nothing: any drift is the dtype's.
    drift = await alone(recorded, float32_engine.url)
    print(f"PROBE float32 alone against the recording: {drift.verdict_line()}")
    assert drift.mean_kl > 0 and drift.max_kl > drift.mean_kl
    assert drift.exact_match_rate < 1

    # Batched, as `draftgen probe` runs, against the noise floor of the same probe on the
    # engine itself, with thresholds set by that floor (as docs/data-quality.md says to set them).
    same = batched_self
    strict = ProbeThresholds(max_mean_kl=CLEAR_OF_NOISE * same.mean_kl, min_top1=0.0,
                             min_exact_match=same.exact_match_rate)
    other = await probe(local_engine.url, float32_engine.url, strict)
    print(f"PROBE float32 batched: {other.verdict_line()}; engine against itself: "
          f"{same.verdict_line()}")
    # The tiny random model's distributions are nearly flat, so absolute KLs are small;
    # what must hold is a gap no run-to-run noise explains, seen by every measure.
    assert other.mean_kl > CLEAR_OF_NOISE * same.mean_kl
    assert other.max_kl > other.mean_kl > 0
    assert other.exact_match_rate < same.exact_match_rate
    assert other.mean_first_divergence is not None
    assert other.mean_matching_prefix < same.mean_matching_prefix
    # A verdict held to the noise floor turns the drift into a failure, with its reasons.
    assert not other.passed
    assert any("mean KL" in f for f in other.failures)
    assert any("exact match" in f for f in other.failures)

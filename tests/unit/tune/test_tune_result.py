"""What a tune hands back: the best profile written (and read back), the table, the plot;
the probe against a recorded reference; one trial that fails to launch."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from draftgen.probe import ProbeThresholds
from draftgen.sample import Sample
from draftgen.servers import load_profile, profile_hash
from draftgen.servers.tune_section import Levers
from draftgen.tune import Row, TuneResult, format_table
from draftgen.tune.candidates import candidate_for
from draftgen.tune.directory import Trial, TuneDir
from draftgen.tune.levers import apply_levers
from draftgen.tune.measure import Measurer, MeasureSettings, launch_reason
from draftgen.tune.referee import (
    RecordedReference,
    load_reference,
    probe_against,
    record_reference,
)
from draftgen.tune.result import build_rows, draw_speed_vs_drift, write_profile
from helpers.scoring_standin import PROMPTS, FakeModel, StandIn, serving

REPO = Path(__file__).resolve().parents[3]
LOCAL_CPU = REPO / "examples" / "profiles" / "local-cpu.yaml"
KIMI = REPO / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"


@pytest.mark.parametrize("source, levers", [
    (LOCAL_CPU, Levers(max_running_requests=16, chunked_prefill=4096, prefix_cache=False,
                       cpu_kv_gib=2)),
    (KIMI, Levers(mem_fraction=0.9, hicache_gb_per_rank=0, chunked_prefill=16384)),
    (KIMI, Levers()),
])
def test_the_best_profile_round_trips_through_load_profile(
        source: Path, levers: Levers, tmp_path: Path) -> None:
    best = apply_levers(load_profile(source), levers)
    path = write_profile(tmp_path / "out" / "best.yaml", best, ["tuned for a test", "line 2"])
    text = path.read_text()
    assert text.startswith("# tuned for a test\n# line 2\n")
    assert "kv_cache_dtype: bfloat16" in text and "tune:" not in text
    again = load_profile(path)
    assert profile_hash(again) == profile_hash(best)
    assert again.model_path == best.model_path and again.name == best.name


def row(label: str, **kw: object) -> Row:
    return Row(candidate=label, label=label, origin="grid", status="measured", **kw)  # type: ignore[arg-type]


def test_table_and_plot(tmp_path: Path) -> None:
    rows = (row("reference", rung=1, kv_tokens=1_048_576, tok_s=40.0, first_tok_s=41.0,
                predicted_s=300.0, ratio=1.0, verdict="reference"),
            row("max_running_requests=16", rung=1, kv_tokens=1_048_576, tok_s=120.0,
                first_tok_s=118.0, predicted_s=100.0, ratio=0.33, probe_kl=0.0,
                probe_top1=1.0, verdict="pass"),
            Row("x", "kv_cache_dtype=fp8", "grid", "rejected", 0, 2_097_152, None, 125.0,
                125.0, None, None, 4e-5, 0.88, "FAIL", "probe: top-1 agreement 88.00% < 97%"),
            Row("y", "chunked_prefill=4096", "grid", "not measured",
                note="not measured: the budget ran out"))
    plot = draw_speed_vs_drift(rows, ProbeThresholds(), rows[1], tmp_path / "tune.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = TuneResult(tmp_path, rows, rows[0], rows[1], tmp_path / "best.yaml", plot,
                        200.0, 290.0, 600.0, True)
    text = format_table(result)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["candidate", "rung", "KV", "tokens"]
    assert "2,097,152" in text and "FAIL" in text and "88.0%" in text
    assert "best: max_running_requests=16 — the job predicted in 1m40s against 5m00s" in text
    assert "stopped by the budget (1 candidate(s) not measured)" in text


def test_rows_pair_each_candidate_with_the_reference_at_its_rung() -> None:
    ref, fast, slow = (candidate_for(Levers()), candidate_for(Levers(max_running_requests=16)),
                       candidate_for(Levers(max_running_requests=1)))
    trials = [Trial(ref.id, 0, {}, "reference", "measured", tok_s=10.0),
              Trial(fast.id, 0, fast.levers.changes(), "grid", "measured", tok_s=30.0,
                    probe={"passed": True, "mean_kl": 0.0, "top1_agreement": 1.0}),
              Trial(ref.id, 1, {}, "reference", "measured", tok_s=12.0),
              Trial(fast.id, 1, fast.levers.changes(), "grid", "measured", tok_s=36.0)]
    rows = build_rows([ref, fast, slow], trials, lambda t: 100.0 / (t.tok_s or 1))
    assert [(r.rung, r.ratio) for r in rows[:2]] == [(1, 1.0), (1, pytest.approx(1 / 3))]
    assert rows[1].first_tok_s == 30.0 and rows[1].tok_s == 36.0 and rows[1].verdict == "pass"
    assert rows[2].status == "not measured"


async def test_probe_against_a_recorded_reference(tmp_path: Path) -> None:
    ref, twin, noisy = StandIn("vllm"), StandIn("vllm"), StandIn("vllm", FakeModel(noise=1.5))
    with serving(ref, twin, noisy):
        recorded = await record_reference(ref.url, PROMPTS[:6], model=None, max_tokens=10,
                                          top_k=8)
        recorded.save(tmp_path / "ref.json")
        loaded = load_reference(tmp_path / "ref.json")
        assert loaded == recorded
        same = await probe_against(loaded, twin.url, thresholds=ProbeThresholds())
        drift = await probe_against(loaded, noisy.url, thresholds=ProbeThresholds())
    assert same.passed and same.mean_kl == pytest.approx(0.0) and same.exact_match_rate == 1.0
    assert not drift.passed and drift.top1_agreement < 0.97
    # The reference was asked once: candidates never render or score on it again.
    assert len(ref.requests("/tokenize")) == 6
    assert load_reference(tmp_path / "missing.json") is None
    assert isinstance(recorded, RecordedReference)


def fake_engine(tmp_path: Path, message: str) -> str:
    """An interpreter that prints an engine's complaint and exits, as a bad flag would."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho 'INFO starting'\necho '{message}' >&2\nexit 2\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def settings(tmp_path: Path, profile_path: Path) -> MeasureSettings:
    return MeasureSettings(
        reference=load_profile(profile_path), tune_dir=TuneDir(tmp_path / "tune"), model="tiny",
        samples=[Sample("a-1", "a", "short", ({"role": "user", "content": "hi"},), 8)],
        base={"model": "tiny"}, concurrency={"short": 1},
        probe_prompts=[[{"role": "user", "content": "hi"}]], launch_timeout_s=30)


async def test_a_launch_failure_is_a_recorded_result(tmp_path: Path) -> None:
    python = fake_engine(tmp_path, "api_server.py: error: unrecognized arguments: --bogus")
    profile = tmp_path / "p.yaml"
    profile.write_text(LOCAL_CPU.read_text().replace("# python: ../../.venv/bin/python",
                                                     f"python: {python}")
                       .replace("../../.cache/tiny-model", str(tmp_path)))
    measure = Measurer(settings(tmp_path, profile))
    trial = await measure(candidate_for(Levers(max_running_requests=16)), 0, 1.0)
    assert trial.status == "failed", trial
    assert "unrecognized arguments: --bogus" in trial.reason
    assert (tmp_path / "tune" / "servers").is_dir()
    # A lossy dtype without the profile's override never starts.
    refused = await measure(candidate_for(Levers(kv_cache_dtype="fp8")), 0, 1.0)
    assert refused.status == "refused" and "lossy" in refused.reason
    assert not any(p.name.startswith("tune-") and p.name.endswith(refused.candidate)
                   for p in (tmp_path / "tune" / "servers").iterdir())
    assert os.path.exists(python)


def test_launch_reason_keeps_the_line_that_names_the_error() -> None:
    error = RuntimeError("vllm exited (code 1) while starting\nINFO a\n"
                         "torch.OutOfMemoryError: CUDA out of memory\nINFO b")
    assert launch_reason(error) == ("vllm exited (code 1) while starting: "
                                    "torch.OutOfMemoryError: CUDA out of memory")


# What vLLM's CPU build logs for fp8 KV on a CPU without AVX-512: the root cause in the
# engine core's traceback, then its wrappers' errors, then more log.
FP8_REFUSAL = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
WRAPPER = ("RuntimeError: Engine core initialization failed. See root cause above. "
           "Failed core proc(s): {}")


def refusing_engine(tmp_path: Path, lines: list[str], noise: int = 0) -> str:
    """An interpreter that logs `lines` (and `noise` lines after them) and exits 1."""
    script = tmp_path / "python"
    body = "".join(f"echo '{line}' >&2\n" for line in lines)
    script.write_text("#!/bin/sh\necho 'INFO starting'\n" + body
                      + f"i=0; while [ $i -lt {noise} ]; do echo \"INFO shutting down $i\"; "
                        "i=$((i+1)); done\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def lossy_allowed_profile(tmp_path: Path, python: str) -> Path:
    profile = tmp_path / "p.yaml"
    profile.write_text(LOCAL_CPU.read_text().replace("# python: ../../.venv/bin/python",
                                                     f"python: {python}")
                       .replace("../../.cache/tiny-model", str(tmp_path))
                       + 'quality: {allow_lossy_kv_cache: true, reason: "a test"}\n')
    return profile


async def test_a_setting_the_engine_refuses_here_is_refused_not_failed(tmp_path: Path) -> None:
    # The root cause is far above the end of the log (the launch error keeps only its tail).
    python = refusing_engine(tmp_path, ["Traceback (most recent call last):", FP8_REFUSAL,
                                        "Traceback (most recent call last):", WRAPPER],
                             noise=400)
    measure = Measurer(settings(tmp_path, lossy_allowed_profile(tmp_path, python)))
    fp8 = candidate_for(Levers(max_running_requests=16, kv_cache_dtype="fp8"))
    trial = await measure(fp8, 0, 1.0)
    assert trial.status == "refused", trial
    assert trial.reason == ("engine refused: FP8 KV cache on CPU requires x86 with AVX-512 "
                            "or AMX.")
    # In the table: refused by the engine, with what it said; no probe verdict.
    ref = Trial("reference", 0, {}, "reference", "measured", tok_s=10.0)
    rows = build_rows([candidate_for(Levers()), fp8], [ref, trial], lambda t: 100.0)
    assert (rows[1].status, rows[1].verdict) == ("refused", "-")
    assert rows[1].note.startswith("engine refused: FP8 KV cache")
    result = TuneResult(tmp_path, tuple(rows), rows[0], None, None, None, None, 1.0, 10.0,
                        False)
    line = next(ln for ln in format_table(result).splitlines() if fp8.label in ln)
    assert "refused" in line and "engine refused: FP8 KV cache on CPU" in line


@pytest.mark.parametrize("lines, status", [
    # Memory is not a refusal: a smaller setting or another machine may run it.
    (["ValueError: No available memory for the cache blocks. Try increasing "
      "`gpu_memory_utilization`", WRAPPER], "failed"),
    (["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"], "failed"),
    # A crash with no word of support: a failure.
    (["AssertionError: block table mismatch", WRAPPER], "failed"),
    (["api_server.py: error: unrecognized arguments: --bogus"], "failed"),
    # What the engine says it cannot do, however it says it.
    (["NotImplementedError", "NotImplementedError: fp8_e5m2 on this platform"], "refused"),
    (["ValueError: Speculative decoding is not supported on the CPU backend"], "refused"),
])
async def test_only_what_the_engine_says_it_cannot_run_is_refused(
        tmp_path: Path, lines: list[str], status: str) -> None:
    python = refusing_engine(tmp_path, lines)
    measure = Measurer(settings(tmp_path, lossy_allowed_profile(tmp_path, python)))
    trial = await measure(candidate_for(Levers(kv_cache_dtype="fp8")), 0, 1.0)
    assert trial.status == status, trial
    assert trial.reason.startswith("engine refused: ") == (status == "refused")


async def test_an_engine_that_dies_quoting_its_key_leaves_it_in_no_trial(tmp_path: Path) -> None:
    # The engine dumps its arguments (as vLLM's "non-default args" does) and dies with an
    # error naming the key: the trial's reason quotes that line, never the key.
    key = "sk-dying-engine-4c1d"
    python = refusing_engine(tmp_path, [f"non-default args: {{'api_key': ['{key}']}}",
                                        f"ValueError: no model for key {key} here"])
    profile = tmp_path / "p.yaml"
    profile.write_text(LOCAL_CPU.read_text().replace("# python: ../../.venv/bin/python",
                                                     f"python: {python}")
                       .replace("../../.cache/tiny-model", str(tmp_path))
                       .replace("  - --enforce-eager", f"  - --api-key\n  - {key}\n"
                                                       "  - --enforce-eager"))
    events: list[str] = []
    measure = Measurer(replace(settings(tmp_path, profile), on_event=events.append))
    trial = await measure(candidate_for(Levers(max_running_requests=16)), 0, 1.0)
    assert trial.status == "failed" and "ValueError: no model for key *** here" in trial.reason
    assert key not in trial.to_line().decode()
    assert all(key not in e for e in events)
    (server,) = (tmp_path / "tune" / "servers").iterdir()
    assert key not in (server / "state.json").read_text()
    log = (server / "server.log").read_text()
    # What draftgen wrote of the command line is redacted; the engine's own lines are its.
    (command,) = [ln for ln in log.splitlines() if ln.startswith("=== draftgen serve")]
    assert "--api-key ***" in command and key not in command


def test_the_table_says_which_paths_the_probe_checked_and_their_noise_floor() -> None:
    from draftgen.tune.result import probe_line

    gate = {"confidence": 0.99, "paths": [
        {"path": "decode", "floor_mean_kl": 2.5e-9}, {"path": "cache read",
                                                      "floor_mean_kl": 0.0}]}
    rows = [Row("reference", "reference", "reference", "measured"),
            Row("c1", "dcp=8", "grid", "measured", gate=gate)]
    line = probe_line(rows)
    assert "prefill (fixed thresholds), decode, cache read" in line
    assert "99% confidence" in line and "decode 2.5e-09" in line
    assert probe_line(rows[:1]) == "probe: the prefill path, against fixed thresholds"


def test_the_table_gives_the_greedy_paths_floor_as_tokens_not_followed() -> None:
    from draftgen.tune.result import probe_line

    gate = {"confidence": 0.99, "paths": [
        {"path": "greedy (no decode logprobs)", "floor_not_followed": 0.025,
         "floor_exact_match": 0.9}]}
    line = probe_line([Row("c1", "speculative", "grid", "measured", gate=gate)])
    assert "prefill (fixed thresholds), greedy (no decode logprobs)" in line
    assert "greedy (no decode logprobs) 2.5% of tokens not followed" in line

"""The tune's grid per engine, and a candidate's levers applied to the reference profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.engines.install import EngineInstall
from draftgen.errors import JobError
from draftgen.servers import engine_for, load_profile, profile_hash
from draftgen.servers.profile import ServerProfile
from draftgen.servers.tune_section import Levers
from draftgen.tune.candidates import (
    REFERENCE,
    HostFacts,
    build_grid,
    candidate_for,
    combine,
    is_mla_model,
    not_binding,
)
from draftgen.tune.directory import Trial
from draftgen.tune.levers import apply_levers, drop_flag, flag_value, set_flag
from draftgen.tune.predict import KvDemand

REPO = Path(__file__).resolve().parents[3]
LOCAL_CPU = REPO / "examples" / "profiles" / "local-cpu.yaml"
KIMI = REPO / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"
SGLANG = EngineInstall("sglang", "python", "0.5.23",
                       frozenset({"--attn-dp-size", "--enable-dp-attention"}))
NO_RAM = HostFacts(available_bytes=None)


def labels(grid: list[Any]) -> list[str]:
    return [c.label for c in grid]


def variant(path: Path, tmp_path: Path, **changes: Any) -> ServerProfile:
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    if path == LOCAL_CPU:
        data["model_path"] = str(REPO / ".cache" / "tiny-model")
    out = tmp_path / "p.yaml"
    out.write_text(yaml.safe_dump(data))
    return load_profile(out)


def test_default_grid_for_the_local_cpu_engine() -> None:
    grid = build_grid(load_profile(LOCAL_CPU), job_concurrency=20, host=NO_RAM)
    # KV size on the CPU build, the running limit (8 is below the job's 20: raised to it),
    # the prefill chunk (vLLM CPU's default 2048, doubled); no lossy dtype without the
    # override.
    assert labels(grid) == ["reference", "cpu_kv_gib=2", "max_running_requests=20",
                            "chunked_prefill=4096"]
    # At or above the job's concurrency, the limit is doubled.
    roomy = build_grid(load_profile(LOCAL_CPU).model_copy(update={"max_running_requests": 64}),
                       job_concurrency=20, host=NO_RAM)
    assert "max_running_requests=128" in labels(roomy)
    assert grid[0].id == REFERENCE and grid[0].is_reference


def test_default_grid_for_the_kimi_profile_on_sglang() -> None:
    host = HostFacts(available_bytes=600 * 10**9, install=SGLANG, mla=True)
    grid = build_grid(load_profile(KIMI), job_concurrency=182, host=host)
    # dp_attention is already on; HiCache is on, so the grid tries it off.
    assert labels(grid) == ["reference", "mem_fraction=0.9", "mem_fraction=0.92",
                            "max_running_requests=1024", "chunked_prefill=16384",
                            "hicache_gb_per_rank=0"]


def test_lossy_kv_is_tried_only_under_the_quality_override(tmp_path: Path) -> None:
    allowed = variant(KIMI, tmp_path, quality={"allow_lossy_kv_cache": True, "reason": "t"})
    grid = build_grid(allowed, 182, HostFacts(install=SGLANG))
    assert labels(grid)[-1] == "kv_cache_dtype=fp8_e4m3"
    cpu = variant(LOCAL_CPU, tmp_path, quality={"allow_lossy_kv_cache": True, "reason": "t"})
    assert labels(build_grid(cpu, 20, NO_RAM))[-1] == "kv_cache_dtype=fp8"


def test_dp_attention_for_an_mla_model_where_the_release_has_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 512}}))
    assert is_mla_model(str(model)) is True
    assert is_mla_model(str(tmp_path / "absent")) is None
    plain = variant(KIMI, tmp_path, dp=1, dp_attention=False, model_path=str(model))
    with_it = build_grid(plain, 100, HostFacts(install=SGLANG, mla=True))
    assert "dp_attention=true" in labels(with_it)
    old = EngineInstall("sglang", "python", "0.4.0", frozenset({"--tp-size"}))
    assert "dp_attention=true" not in labels(build_grid(plain, 100,
                                                        HostFacts(install=old, mla=True)))
    dp = apply_levers(plain, Levers(dp_attention=True))
    assert dp.dp_attention and dp.dp == dp.tp == 8


def test_hicache_default_size_fits_the_host_ram(tmp_path: Path) -> None:
    off = variant(KIMI, tmp_path, hierarchical_cache={"enabled": False})
    # 8 ranks; 200 GB available minus SGLang's 10 GiB reserve: 23 GB per rank.
    grid = build_grid(off, 100, HostFacts(available_bytes=200 * 10**9, install=SGLANG))
    assert "hicache_gb_per_rank=23" in labels(grid)
    tiny = build_grid(off, 100, HostFacts(available_bytes=11 * 10**9, install=SGLANG))
    assert not any(lb.startswith("hicache") for lb in labels(tiny))


def test_the_tune_section_narrows_the_grid(tmp_path: Path) -> None:
    narrowed = variant(LOCAL_CPU, tmp_path, tune={
        "max_running_requests": [16, 8], "cpu_kv_gib": [], "chunked_prefill": [],
        "prefix_cache": [False], "model_dtype": ["float32"]})
    # 8 is the reference's own value: no candidate for it.
    assert labels(build_grid(narrowed, 20, NO_RAM)) == [
        "reference", "max_running_requests=16", "prefix_cache=false", "model_dtype=float32"]
    drafted = variant(LOCAL_CPU, tmp_path, tune={
        "max_running_requests": [], "cpu_kv_gib": [], "chunked_prefill": [],
        "speculative": {"method": "ngram"}})
    assert labels(build_grid(drafted, 20, NO_RAM)) == ["reference", "speculative=true"]
    listed = variant(LOCAL_CPU, tmp_path, tune={"candidates": [
        {"max_running_requests": 16}, {"max_running_requests": 16, "kv_cache_dtype": "fp8"}]})
    grid = build_grid(listed, 20, NO_RAM)
    assert labels(grid) == ["reference", "max_running_requests=16",
                            "max_running_requests=16, kv_cache_dtype=fp8"]
    assert {c.origin for c in grid[1:]} == {"listed"}


def test_the_tune_section_is_checked_and_left_out_of_the_hash(tmp_path: Path) -> None:
    plain = variant(LOCAL_CPU, tmp_path)
    tuned = variant(LOCAL_CPU, tmp_path, tune={"max_running_requests": [8]})
    assert profile_hash(plain) == profile_hash(tuned)
    with pytest.raises(JobError, match=r"tune\.max_running_requests"):
        variant(LOCAL_CPU, tmp_path, tune={"max_running_requests": [0]})
    with pytest.raises(JobError, match=r"tune\.nope"):
        variant(LOCAL_CPU, tmp_path, tune={"nope": [1]})


def test_candidate_ids_are_stable_and_name_the_levers() -> None:
    a = candidate_for(Levers(max_running_requests=16, kv_cache_dtype="FP8"))
    b = candidate_for(Levers(kv_cache_dtype="fp8", max_running_requests=16))
    assert a.id == b.id and len(a.id) == 8
    assert a.label == "max_running_requests=16, kv_cache_dtype=fp8"
    assert candidate_for(Levers()).id == REFERENCE


def test_vllm_levers_become_flags_fields_and_env(tmp_path: Path) -> None:
    ref = variant(LOCAL_CPU, tmp_path, extra_args=["--enforce-eager",
                                                   "--max-num-batched-tokens", "512"],
                  tune={"speculative": {"method": "ngram", "num_tokens": 3}})
    cand = apply_levers(ref, Levers(max_running_requests=16, chunked_prefill=4096,
                                    prefix_cache=False, speculative=True, cpu_kv_gib=2,
                                    kv_cache_dtype="fp8", model_dtype="float32"))
    argv = engine_for("vllm").argv(cand)
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv.count("--max-num-batched-tokens") == 1
    assert flag_value(argv, "--max-num-batched-tokens") == "4096"
    assert "--no-enable-prefix-caching" in argv
    spec = json.loads(flag_value(argv, "--speculative-config") or "{}")
    assert spec == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2}
    assert cand.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # The reference is untouched, and a lever set back to the default drops the flag.
    assert "--no-enable-prefix-caching" not in engine_for("vllm").argv(ref)
    back = apply_levers(cand, Levers(prefix_cache=True, speculative=False))
    assert "--enable-prefix-caching" in back.extra_args
    assert flag_value(back.extra_args, "--speculative-config") is None


def test_sglang_levers_become_its_flags(tmp_path: Path) -> None:
    ref = variant(KIMI, tmp_path, extra_args=["--trust-remote-code", "--chunked-prefill-size",
                                              "8192"],
                  tune={"speculative": {"method": "EAGLE3", "draft_model": "org/kimi-eagle3",
                                        "num_tokens": 4}})
    cand = apply_levers(ref, Levers(chunked_prefill=16384, prefix_cache=False,
                                    speculative=True, hicache_gb_per_rank=0,
                                    mem_fraction=0.9))
    argv = engine_for("sglang").argv(cand, install=SGLANG)
    assert flag_value(argv, "--chunked-prefill-size") == "16384"
    assert argv.count("--chunked-prefill-size") == 1
    assert "--disable-radix-cache" in argv
    assert "--enable-hierarchical-cache" not in argv and "--hicache-size" not in argv
    # HiCache extends the radix cache: without a prefix cache it goes too (SGLang refuses
    # the pair), and asking for both is refused here.
    alone = apply_levers(ref, Levers(prefix_cache=False))
    assert not alone.hierarchical_cache.enabled
    with pytest.raises(JobError, match="exclude each other"):
        apply_levers(ref, Levers(prefix_cache=False, hicache_gb_per_rank=8))
    assert flag_value(argv, "--mem-fraction-static") == "0.9"
    assert [flag_value(argv, f) for f in (
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens")] == [
        "EAGLE3", "org/kimi-eagle3", "3", "1", "4"]


def test_a_lever_the_profile_cannot_take_is_refused(tmp_path: Path) -> None:
    cpu = load_profile(LOCAL_CPU)
    with pytest.raises(JobError, match="dp_attention"):
        apply_levers(cpu, Levers(dp_attention=True))
    with pytest.raises(JobError, match="names no draft"):
        apply_levers(cpu, Levers(speculative=True))
    with pytest.raises(JobError, match="kv_cache_dtype"):
        apply_levers(load_profile(KIMI), Levers(kv_cache_dtype="float16"))


def test_flag_editing() -> None:
    args = ["--a", "1", "--b=2", "--flag", "--a", "3"]
    assert flag_value(args, "--a") == "3" and flag_value(args, "--b") == "2"
    assert drop_flag(args, "--a", valued=True) == ["--b=2", "--flag"]
    assert drop_flag(args, "--flag", valued=False) == ["--a", "1", "--b=2", "--a", "3"]
    assert set_flag(args, "--b", "5") == ["--a", "1", "--flag", "--a", "3", "--b", "5"]


def test_combined_takes_the_best_value_of_each_lever_that_helped() -> None:
    cands = [candidate_for(Levers()),
             candidate_for(Levers(max_running_requests=16)),
             candidate_for(Levers(max_running_requests=32)),
             candidate_for(Levers(chunked_prefill=4096)),
             candidate_for(Levers(prefix_cache=False))]
    gains = {"max_running_requests=16": 0.8, "max_running_requests=32": 0.7,
             "chunked_prefill=4096": 0.9, "prefix_cache=false": None}
    merged = combine(cands, lambda c: gains.get(c.label))
    assert merged is not None and merged.origin == "combined"
    assert merged.levers == Levers(max_running_requests=32, chunked_prefill=4096)
    assert combine(cands, lambda c: 0.5 if c.label == "chunked_prefill=4096" else None) is None


def test_draft_model_path_resolves_from_the_profile(tmp_path: Path) -> None:
    (tmp_path / "draft").mkdir()
    p = variant(KIMI, tmp_path, tune={"speculative": {"method": "EAGLE3",
                                                      "draft_model": "./draft"}})
    assert p.tune is not None and p.tune.speculative is not None
    assert p.tune.speculative.draft_model == str(tmp_path / "draft")
    assert sys.executable  # the profile's interpreter default is untouched


def reference_trial(kv_tokens: int = 100_000, max_running: int | None = 8,
                    **load: object) -> Trial:
    return Trial(REFERENCE, 0, {}, "reference", "measured", tok_s=100.0, load=dict(load),
                 kv_tokens=kv_tokens, max_running=max_running)


def projected(running: float, footprint: float, preemptions: int = 0) -> Any:
    """A projection of the job's KV demand on the reference, whatever the trial."""
    demand = KvDemand(running=running, footprint=footprint, concurrency=20,
                      preemptions=preemptions)
    return lambda trial: demand


def test_a_lever_that_did_not_bind_for_the_reference_is_skipped(tmp_path: Path) -> None:
    grid = {c.label: c for c in build_grid(load_profile(LOCAL_CPU), 20, NO_RAM)}
    kv, limit = grid["cpu_kv_gib=2"], grid["max_running_requests=20"]
    chunk = grid["chunked_prefill=4096"]
    # The job would hold 8 × 300 tokens: 2% of the reference's 100,000.
    skip = not_binding(load_profile(LOCAL_CPU), projected(8, 300))
    idle = reference_trial(kv_peak=0.01, running_peak=5, waiting_peak=0, preempted=0)
    why = skip(kv, idle) or ""
    assert "peaked at 1%" in why and "8 running × 300 tokens = 2,400" in why, why
    assert "2% of its 100,000 KV tokens" in why, why
    assert "at most 5 requests at once, below its limit of 8" in (skip(limit, idle) or "")
    assert skip(chunk, idle) is None  # nothing in the readings tells
    # A cache that preempted, or ran near full, binds; a limit reached binds.
    assert skip(kv, reference_trial(kv_peak=0.3, running_peak=8, preempted=2)) is None
    assert skip(kv, reference_trial(kv_peak=0.9, running_peak=8, preempted=0)) is None
    assert skip(limit, reference_trial(kv_peak=0.01, running_peak=8, preempted=0)) is None
    # Unread load, values the profile asks for, and combinations are always measured.
    assert skip(kv, Trial(REFERENCE, 0, {}, "reference", "measured")) is None
    asked = variant(LOCAL_CPU, tmp_path, tune={"cpu_kv_gib": [2]})
    assert not_binding(asked, projected(8, 300))(candidate_for(Levers(cpu_kv_gib=2)),
                                                 idle) is None
    both = candidate_for(Levers(cpu_kv_gib=2, max_running_requests=20), "combined")
    assert skip(both, idle) is None


def test_more_kv_is_tried_where_the_jobs_projected_demand_fills_the_cache() -> None:
    # Long answers fill the cache hours into a run: a 20-second window that peaked at 5%
    # says nothing of that; the capacity model's projection of the whole job does.
    grid = {c.label: c for c in build_grid(load_profile(KIMI), 182,
                                           HostFacts(install=SGLANG, mla=True))}
    more = grid["mem_fraction=0.9"]
    early = reference_trial(kv_tokens=100_000, max_running=512, kv_peak=0.05, preempted=0)
    # 182 running × 4,500 tokens: 819,000, eight times the cache.
    assert not_binding(load_profile(KIMI), projected(182, 4_500))(more, early) is None
    # Under 80% of it, but the simulation of the whole job preempts: it binds all the same.
    assert not_binding(load_profile(KIMI), projected(182, 400, 12))(more, early) is None
    # Without a projection the peak alone is no reason to leave KV out.
    assert not_binding(load_profile(KIMI))(more, early) is None
    # A job whose demand stays far below it, and a window that agrees: skipped.
    why = not_binding(load_profile(KIMI), projected(182, 100))(more, early)
    assert why is not None and "18,200" in why


def test_a_candidate_that_changes_nothing_is_not_measured(tmp_path: Path) -> None:
    # Prefix caching is vLLM's default; 512 is the reference's own prefill chunk; 128 the
    # running limit the reference's server reported using (the profile sets none).
    ref = variant(LOCAL_CPU, tmp_path, max_running_requests=None,
                  extra_args=["--enforce-eager", "--max-num-batched-tokens", "512"])
    trial = reference_trial(max_running=128, kv_peak=0.95, running_peak=128, preempted=3)
    skip = not_binding(ref, projected(128, 300))
    for levers in (Levers(prefix_cache=True), Levers(chunked_prefill=512),
                   Levers(max_running_requests=128),
                   Levers(prefix_cache=True, chunked_prefill=512)):
        for origin in ("grid", "listed", "combined"):
            why = skip(candidate_for(levers, origin), trial)
            assert why is not None and "changes nothing" in why, (levers, origin, why)
    for levers in (Levers(prefix_cache=False), Levers(chunked_prefill=1024),
                   Levers(max_running_requests=256),
                   Levers(prefix_cache=True, chunked_prefill=1024)):
        assert skip(candidate_for(levers, "listed"), trial) is None, levers

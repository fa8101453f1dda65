"""Every candidate `draftgen tune` can launch, read by the engine's own argument code.

For the Kimi example on SGLang 0.5.23 and 0.5.9, and the local CPU example on vLLM, the
tune section lists a value for every lever the engine has (memory fraction, running limit,
prefill chunk, prefix cache, HiCache, DP attention, speculative decoding with a draft, the
compute dtype, a lossy KV dtype under the quality override); the grid's candidates are
launched as argv, each release parses and resolves it, and the resolved arguments must mean
what the candidate's levers say. The lossy one is only parsed here: whether it may run is
the quality policy's and the probe's decision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ORACLES, Oracle

from draftgen.engines.install import EngineInstall
from draftgen.engines.registry import engine_for
from draftgen.servers.profile import ServerProfile, load_profile
from draftgen.servers.tune_section import Levers
from draftgen.tune.candidates import HostFacts, build_grid
from draftgen.tune.levers import apply_levers

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"
LOCAL_CPU = ROOT / "examples" / "profiles" / "local-cpu.yaml"
# A checkpoint folder with only config.json: what the release reads of a draft model.
DRAFT = str(ORACLES / "cfg-only")


def tuned(path: Path, tmp_path: Path, tune: dict[str, Any]) -> ServerProfile:
    data = yaml.safe_load(path.read_text())
    data["quality"] = {"allow_lossy_kv_cache": True, "reason": "conformance: parse only"}
    data["tune"] = tune
    if path == LOCAL_CPU:
        data["model_path"] = "/models/m"
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data))
    return load_profile(out)


SGLANG_TUNE = {
    "mem_fraction": [0.9], "max_running_requests": [1024], "chunked_prefill": [16384],
    "prefix_cache": [False], "hicache_gb_per_rank": [0, 32], "dp_attention": [False],
    "kv_cache_dtype": ["fp8_e4m3"],
    "speculative": {"method": "EAGLE3", "draft_model": DRAFT, "num_tokens": 4},
}


def sglang_expected(levers: dict[str, Any], profile: ServerProfile) -> dict[str, Any]:
    want: dict[str, Any] = {}
    if "mem_fraction" in levers:
        want["mem_fraction_static"] = levers["mem_fraction"]
    if "max_running_requests" in levers:
        want["max_running_requests"] = levers["max_running_requests"]
    if "chunked_prefill" in levers:
        # The flag is the whole TP group's: each DP-attention rank prefills its share.
        ranks = profile.dp if profile.dp_attention else 1
        want["chunked_prefill_size"] = levers["chunked_prefill"] // ranks
    if "prefix_cache" in levers:
        want["disable_radix_cache"] = not levers["prefix_cache"]
    if "hicache_gb_per_rank" in levers:
        size = levers["hicache_gb_per_rank"]
        want["enable_hierarchical_cache"] = bool(size)
        if size:
            want["hicache_size"] = size
    if "dp_attention" in levers:
        want["enable_dp_attention"] = levers["dp_attention"]
    if "dcp" in levers:
        want["dcp_size"] = levers["dcp"]
        if profile.dp_attention:  # DCP replaces DP attention
            want["enable_dp_attention"] = False
    if levers.get("speculative_adaptive"):
        want["speculative_adaptive"] = True
    if "kv_cache_dtype" in levers:
        want["kv_cache_dtype"] = levers["kv_cache_dtype"]
    if levers.get("speculative"):
        want.update(speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4,
                    speculative_eagle_topk=1, speculative_num_steps=3)
    return want


def test_every_sglang_candidate_parses_and_means_its_levers(
    sglang_oracle: Oracle, sglang_options: dict[str, frozenset[str]], tmp_path: Path,
) -> None:
    version = sglang_oracle.version
    install = EngineInstall("sglang", "python", version, sglang_options[version])
    profile = tuned(KIMI, tmp_path, SGLANG_TUNE)
    grid = build_grid(profile, 182, HostFacts(available_bytes=600 * 10**9, install=install,
                                              mla=True))
    # DCP where the release defines it (0.5.23); no adaptive speculative decoding under the
    # profile's DP attention, which SGLang would turn off with a warning.
    newer = {"--dcp-size"} & sglang_options[version]
    assert len(grid) == 10 + len(newer), [c.label for c in grid]
    assert ("dcp=8" in [c.label for c in grid]) == bool(newer)
    assert "speculative_adaptive=true" not in [c.label for c in grid]
    if newer:  # the DCP flag itself, without HiCache (whose DCP path needs the checkpoint)
        dcp = apply_levers(profile, Levers(dcp=8, hicache_gb_per_rank=0))
        parsed = sglang_oracle.ask("parse", argv=engine_for("sglang").argv(
            dcp, install=install)[3:])
        assert parsed["error"] is None, parsed["error"]
        assert parsed["args"]["dcp_size"] == 8
        assert parsed["args"]["enable_dp_attention"] is False
    refused = {}
    for cand in grid:
        argv = engine_for("sglang").argv(apply_levers(profile, cand.levers),
                                         install=install)[3:]
        assert {a.split("=", 1)[0] for a in argv if a.startswith("--")} <= sglang_options[version]
        parsed = sglang_oracle.ask("parse", argv=argv)
        if parsed["error"] is not None:
            if cand.label == "dcp=8" and "only supported for MLA models" in parsed["error"]:
                continue  # HiCache + DCP needs an MLA checkpoint, which the oracle has not
            refused[cand.label] = parsed["error"]
            continue
        got = parsed["args"]
        want = sglang_expected(cand.levers.changes(), profile)
        wrong = {k: (got.get(k, "<absent>"), v) for k, v in want.items()
                 if got.get(k, "<absent>") != v}
        assert not wrong, f"SGLang {version}, {cand.label}: (got, lever) {wrong}"
    assert not refused, f"SGLang {version} refuses {refused}"


def test_adaptive_speculative_decoding_stays_on_where_sglang_can_run_it(
    sglang_oracle: Oracle, sglang_options: dict[str, frozenset[str]], tmp_path: Path,
) -> None:
    version = sglang_oracle.version
    options = sglang_options[version]
    install = EngineInstall("sglang", "python", version, options)
    tune = {"speculative": SGLANG_TUNE["speculative"]}
    plain = tuned(KIMI, tmp_path, tune).model_copy(update={"dp": 1, "dp_attention": False})
    grid = build_grid(plain, 182, HostFacts(install=install, mla=True))
    adaptive = [c for c in grid if c.label == "speculative_adaptive=true"]
    assert bool(adaptive) == ("--speculative-adaptive" in options), [c.label for c in grid]
    for cand in adaptive:
        argv = engine_for("sglang").argv(apply_levers(plain, cand.levers), install=install)[3:]
        parsed = sglang_oracle.ask("parse", argv=argv)
        assert parsed["error"] is None, parsed["error"]
        assert parsed["args"]["speculative_adaptive"] is True
        assert parsed["args"]["speculative_algorithm"] == "EAGLE3"


VLLM_TUNE = {
    "max_running_requests": [16], "chunked_prefill": [4096], "prefix_cache": [False],
    "cpu_kv_gib": [2], "kv_cache_dtype": ["fp8"], "model_dtype": ["float32"],
    "speculative": {"method": "ngram", "num_tokens": 3},
}


def test_every_vllm_candidate_parses_and_means_its_levers(
    vllm_oracle: Oracle, tmp_path: Path,
) -> None:
    profile = tuned(LOCAL_CPU, tmp_path, VLLM_TUNE)
    grid = build_grid(profile, 20, HostFacts())
    assert len(grid) == 8, [c.label for c in grid]
    for cand in grid:
        launched = apply_levers(profile, cand.levers)
        argv = engine_for("vllm").argv(launched)[3:]
        parsed = vllm_oracle.ask("parse", argv=argv)
        assert parsed["error"] is None, f"vLLM refuses {cand.label}: {parsed['error']}"
        got, levers = parsed["args"], cand.levers.changes()
        want: dict[str, Any] = {
            "max_num_seqs": levers.get("max_running_requests", 8),
            "kv_cache_dtype": levers.get("kv_cache_dtype", "bfloat16"),
            "dtype": levers.get("model_dtype", "bfloat16"),
        }
        if "chunked_prefill" in levers:
            want["max_num_batched_tokens"] = levers["chunked_prefill"]
        if "prefix_cache" in levers:
            want["enable_prefix_caching"] = levers["prefix_cache"]
        if "speculative" in levers:
            config = got.get("speculative_config")
            spec = json.loads(config) if isinstance(config, str) else config
            assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
        if "cpu_kv_gib" in levers:
            assert launched.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
        wrong = {k: (got.get(k, "<absent>"), v) for k, v in want.items()
                 if got.get(k, "<absent>") != v}
        assert not wrong, f"vLLM, {cand.label}: (got, lever) {wrong}"


@pytest.mark.parametrize("path", [KIMI, LOCAL_CPU])
def test_the_default_grid_needs_no_tune_section(path: Path) -> None:
    grid = build_grid(load_profile(path), 100, HostFacts())
    assert grid[0].is_reference and len(grid) >= 3

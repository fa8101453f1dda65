"""draftgen's SGLang launch argv, checked against each release's own server-argument code.

For SGLang 0.5.23 and 0.5.9 (installed from PyPI by scripts/install-oracles.sh), the argv
`SGLang.argv` builds for a profile is parsed by that release's own `ServerArgs` parser and
resolved by its own code (0.5.23 `resolve_once`, 0.5.9 `__post_init__`): no flag may be
unknown, no choice invalid, no check may refuse it, and the resolved arguments must mean
what the profile says. Which data-parallel-attention spelling draftgen picks must follow the
release's real option strings, and `Engine.installed` must read the same flags from the
installed files that the release's parser defines.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ORACLES, Oracle

from draftgen.engines.install import EngineInstall
from draftgen.engines.registry import engine_for
from draftgen.servers.profile import ServerProfile, load_profile

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"

# Profiles written to tmp_path next to the shipped example (fields of ServerProfile).
VARIANTS: dict[str, dict[str, Any]] = {
    "minimal": {"engine": "sglang", "model_path": "/models/m"},
    "plain-dp": {
        "engine": "sglang", "model_path": "/models/m", "served_name": "m", "tp": 4, "dp": 2,
        "deterministic_inference": True, "mem_fraction": 0.8, "model_dtype": "bfloat16",
        "kv_cache_dtype": "bfloat16", "reasoning_parser": "qwen3",
        "max_running_requests": 128, "context_length": 32768,
        "hierarchical_cache": {"enabled": True},
        "extra_args": ["--chunked-prefill-size", "4096"],
    },
    "dp-attention-4": {
        "engine": "sglang", "model_path": "/models/m", "served_name": "m", "tp": 8, "dp": 4,
        "dp_attention": True, "deterministic_inference": True, "mem_fraction": 0.85,
        "hierarchical_cache": {"enabled": True, "host_gb_per_rank": 32},
        "kv_cache_dtype": "bf16", "model_dtype": "bfloat16",
        "reasoning_parser": "deepseek-r1", "max_running_requests": 256,
        "context_length": 65536, "port": 31000,
    },
}
PROFILES = ["kimi-example", *VARIANTS]


def profile_named(name: str, tmp_path: Path) -> ServerProfile:
    if name == "kimi-example":
        return load_profile(KIMI)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(VARIANTS[name]))
    return load_profile(path)


def install_for(version: str, options: frozenset[str]) -> EngineInstall:
    return EngineInstall("sglang", "python", version, options)


def launch_argv(profile: ServerProfile, install: EngineInstall) -> list[str]:
    """The engine's own arguments: the argv without interpreter, `-m`, module."""
    full = engine_for("sglang").argv(profile, install=install)
    assert full[1:3] == ["-m", "sglang.launch_server"]
    return full[3:]


def flags_in(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def expected_args(profile: ServerProfile, version: str) -> dict[str, Any]:
    """What the release must resolve the profile's argv to."""
    want: dict[str, Any] = {
        "tp_size": profile.tp,
        "enable_deterministic_inference": profile.deterministic_inference,
        "enable_metrics": True,  # draftgen's load view reads /metrics
        "enable_hierarchical_cache": profile.hierarchical_cache.enabled,
        "reasoning_parser": profile.reasoning_parser,
        "host": profile.host,
        "port": engine_for("sglang").port(profile),
    }
    if profile.dp_attention and version == "0.5.23":
        # 0.5.23: attention DP inside the TP group, no DP replicas.
        want.update(dp_size=1, attn_dp_size=profile.dp, enable_dp_attention=True)
    elif profile.dp_attention:
        want.update(dp_size=profile.dp, enable_dp_attention=True)
    else:
        want.update(dp_size=profile.dp, enable_dp_attention=False)
        if version == "0.5.23":
            want["attn_dp_size"] = 1
    if profile.mem_fraction is not None:
        want["mem_fraction_static"] = profile.mem_fraction
    if profile.hierarchical_cache.host_gb_per_rank is not None:
        want["hicache_size"] = profile.hierarchical_cache.host_gb_per_rank
    if profile.max_running_requests is not None:
        want["max_running_requests"] = profile.max_running_requests
    if profile.context_length is not None:
        want["context_length"] = profile.context_length
    if profile.model_dtype:
        want["dtype"] = profile.model_dtype
    if profile.served_name:
        want["served_model_name"] = profile.served_name
    return want


@pytest.mark.parametrize("name", PROFILES)
def test_launch_argv_parses_and_means_the_profile(
    name: str, sglang_oracle: Oracle, sglang_options: dict[str, frozenset[str]],
    tmp_path: Path,
) -> None:
    version = sglang_oracle.version
    profile = profile_named(name, tmp_path)
    argv = launch_argv(profile, install_for(version, sglang_options[version]))
    assert flags_in(argv) <= sglang_options[version], "flags the release does not define"

    parsed = sglang_oracle.ask("parse", argv=argv)
    assert parsed["error"] is None, f"SGLang {version} refuses {argv}: {parsed['error']}"
    got = parsed["args"]
    want = expected_args(profile, version)
    wrong = {k: (got.get(k, "<absent>"), v) for k, v in want.items() if got.get(k, "<absent>") != v}
    assert not wrong, f"SGLang {version} resolved (got, profile) {wrong}"
    # draftgen writes SGLang's spelling; either is the same 16-bit cache to the release.
    assert got["kv_cache_dtype"] in ("bf16", "bfloat16")


def test_attention_dp_spelling_follows_the_real_parser(
    sglang_options: dict[str, frozenset[str]],
) -> None:
    profile = load_profile(KIMI)
    assert profile.dp_attention and profile.dp == 8
    new = install_for("0.5.23", sglang_options["0.5.23"])
    old = install_for("0.5.9", sglang_options["0.5.9"])
    assert new.has_flag("--attn-dp-size") is True
    assert old.has_flag("--attn-dp-size") is False
    new_argv, old_argv = launch_argv(profile, new), launch_argv(profile, old)
    assert "--attn-dp-size" in new_argv and "--enable-dp-attention" not in new_argv
    assert new_argv[new_argv.index("--attn-dp-size") + 1] == "8"
    assert "--enable-dp-attention" in old_argv and "--attn-dp-size" not in old_argv
    assert old_argv[old_argv.index("--dp-size") + 1] == "8"


@pytest.mark.parametrize("version,argv,fragment", [
    ("0.5.9", ["--attn-dp-size", "8"], "unrecognized arguments"),
    ("0.5.23", ["--kv-cache-dtype", "float16"], "invalid choice"),
    ("0.5.9", ["--reasoning-parser", "no-such-parser"], "invalid choice"),
    ("0.5.23", ["--tp-size", "8", "--dp-size", "8", "--attn-dp-size", "8"], "not supported"),
])
def test_the_oracle_refuses_what_the_release_refuses(
    version: str, argv: list[str], fragment: str, sglang_oracles: dict[str, Oracle],
) -> None:
    """The same parse the argv tests rely on, shown to fail where the release fails."""
    parsed = sglang_oracles[version].ask("parse", argv=["--model-path", "/m", *argv])
    assert parsed["error"] is not None and fragment in parsed["error"], parsed["error"]


def _interpreter_seeing(tree: Path, tmp_path: Path) -> str:
    """An executable that runs this venv's python with only `tree` added to its path."""
    wrapper = tmp_path / f"python-{tree.name}"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{tree}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(wrapper)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.9"])
def test_detect_install_reads_what_the_release_defines(
    version: str, sglang_options: dict[str, frozenset[str]], tmp_path: Path,
) -> None:
    interpreter = _interpreter_seeing(ORACLES / f"sglang-{version}", tmp_path)
    found = engine_for("sglang").installed(interpreter)
    assert found.version == version, found.describe() + f" {found.note}"
    assert found.flags is not None
    real = sglang_options[version]
    assert found.has_flag("--attn-dp-size") is ("--attn-dp-size" in real)
    # Every flag draftgen emits for the example, as chosen from the real parser's options,
    # must be one detect_install reports and one the release's parser defines.
    emitted = flags_in(launch_argv(load_profile(KIMI), install_for(version, real)))
    assert emitted <= real
    assert not emitted - found.flags, f"installed() misses {sorted(emitted - found.flags)}"
    # And what draftgen launches when it goes by detect_install is that same argv.
    assert launch_argv(load_profile(KIMI), found) == launch_argv(
        load_profile(KIMI), install_for(version, real))


def test_versions_under_test_are_installed(sglang_oracles: dict[str, Oracle]) -> None:
    """Each oracle is the release it is named for (its own sglang.version, and its dist
    metadata), with the module draftgen runs with `python -m`."""
    for version, oracle in sglang_oracles.items():
        assert oracle.version == version
        tree = ORACLES / f"sglang-{version}"
        assert (tree / f"sglang-{version}.dist-info" / "METADATA").is_file()
        assert (tree / "sglang" / "launch_server.py").is_file(), "python -m target missing"

"""draftgen's vLLM launch argv, checked against vLLM's own CLI code.

The argv `VLLM.argv` builds for examples/profiles/local-cpu.yaml and a variant with
DP/TP/memory/limits/reasoning parser set is parsed by vLLM's own
`make_arg_parser(FlexibleArgumentParser())` (vllm.entrypoints.launchers.cli_args), checked
by its `validate_parsed_serve_args`, turned into engine arguments, and checked by the API
server's `validate_api_server_args` (which refuses unknown reasoning parsers). The parsed
arguments must mean what the profile says.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Oracle

from draftgen.engines.registry import engine_for
from draftgen.servers.profile import ServerProfile, load_profile

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CPU = ROOT / "examples" / "profiles" / "local-cpu.yaml"

VARIANT: dict[str, Any] = {
    "engine": "vllm", "model_path": "/models/m", "served_name": "m", "tp": 2, "dp": 2,
    "mem_fraction": 0.7, "max_running_requests": 32, "context_length": 2048,
    "reasoning_parser": "deepseek_r1", "kv_cache_dtype": "bf16", "model_dtype": "bfloat16",
    "port": 8100, "extra_args": ["--enforce-eager"],
}


def profile_named(name: str, tmp_path: Path) -> ServerProfile:
    if name == "local-cpu":
        return load_profile(LOCAL_CPU)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(VARIANT))
    return load_profile(path)


def launch_argv(profile: ServerProfile) -> list[str]:
    full = engine_for("vllm").argv(profile)
    assert full[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return full[3:]


def expected_args(profile: ServerProfile) -> dict[str, Any]:
    want: dict[str, Any] = {
        "model": profile.model_path,
        "tensor_parallel_size": profile.tp,
        "data_parallel_size": profile.dp,
        "kv_cache_dtype": profile.kv_cache_dtype,
        "host": profile.host,
        "port": engine_for("vllm").port(profile),
    }
    if profile.served_name:
        want["served_model_name"] = [profile.served_name]
    if profile.mem_fraction is not None:
        want["gpu_memory_utilization"] = profile.mem_fraction
    if profile.max_running_requests is not None:
        want["max_num_seqs"] = profile.max_running_requests
    if profile.context_length is not None:
        want["max_model_len"] = profile.context_length
    if profile.model_dtype:
        want["dtype"] = profile.model_dtype
    if profile.reasoning_parser:
        want["reasoning_parser"] = profile.reasoning_parser
    return want


@pytest.mark.parametrize("name", ["local-cpu", "variant"])
def test_launch_argv_parses_and_means_the_profile(
    name: str, vllm_oracle: Oracle, tmp_path: Path,
) -> None:
    profile = profile_named(name, tmp_path)
    argv = launch_argv(profile)
    options = set(vllm_oracle.ask("option_strings"))
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert flags <= options, f"flags vLLM does not define: {sorted(flags - options)}"

    parsed = vllm_oracle.ask("parse", argv=argv)
    assert parsed["error"] is None, f"vLLM refuses {argv}: {parsed['error']}"
    got = parsed["args"]
    want = expected_args(profile)
    wrong = {k: (got.get(k, "<absent>"), v) for k, v in want.items() if got.get(k, "<absent>") != v}
    assert not wrong, f"vLLM parsed (got, profile) {wrong}"


@pytest.mark.parametrize("argv,fragment", [
    (["--kv-cache-dtype", "bf16"], "invalid choice"),
    (["--reasoning-parser", "no-such-parser"], "invalid reasoning parser"),
    (["--enable-dp-attention"], "unrecognized arguments"),
])
def test_the_oracle_refuses_what_vllm_refuses(
    argv: list[str], fragment: str, vllm_oracle: Oracle,
) -> None:
    parsed = vllm_oracle.ask("parse", argv=["--model", "/m", *argv])
    assert parsed["error"] is not None and fragment in parsed["error"], parsed["error"]


def test_module_draftgen_runs_exists_and_detect_install_finds_vllm(vllm_oracle: Oracle) -> None:
    # Located without importing vLLM into the test process.
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    module = engine_for("vllm").module.split(".")
    assert (Path(spec.submodule_search_locations[0]).joinpath(*module[1:-1])
            / f"{module[-1]}.py").is_file()
    found = engine_for("vllm").installed(sys.executable)
    assert found.version == vllm_oracle.version, found.describe()

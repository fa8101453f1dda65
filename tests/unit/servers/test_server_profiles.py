"""Server profiles: validation that names file and field, path resolution, hash, golden argv."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.engines.install import EngineInstall
from draftgen.errors import JobError
from draftgen.servers import engine_for, load_profile, profile_hash
from draftgen.servers.profile import ServerProfile, default_state_dir

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples" / "profiles"


def write(tmp_path: Path, data: dict[str, Any], name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


SGLANG_0_5_23 = EngineInstall("sglang", "python", "0.5.23",
                              frozenset({"--attn-dp-size", "--enable-dp-attention"}))
SGLANG_0_5_9 = EngineInstall("sglang", "python", "0.5.9", frozenset({"--enable-dp-attention"}))


@pytest.mark.parametrize("install, dp_flags", [
    # 0.5.23 deprecates --enable-dp-attention for --attn-dp-size (removal announced).
    (SGLANG_0_5_23, ["--attn-dp-size", "8"]),
    (SGLANG_0_5_9, ["--dp-size", "8", "--enable-dp-attention"]),
    # Not installed for this interpreter: the newest release's flags.
    (None, ["--attn-dp-size", "8"]),
])
def test_sglang_golden_argv_for_the_8_gpu_example(install: EngineInstall | None,
                                                  dp_flags: list[str]) -> None:
    profile = load_profile(EXAMPLES / "kimi-k2.5-sglang-8gpu.yaml")
    assert engine_for("sglang").argv(profile, install=install) == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/models/Kimi-K2.5",
        "--served-model-name", "kimi-k2.5",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--tp-size", "8",
        *dp_flags,
        "--mem-fraction-static", "0.88",
        "--enable-hierarchical-cache",
        "--hicache-size", "64",
        # Explicit 16-bit, spelled as every SGLang 0.4/0.5 release accepts it.
        "--kv-cache-dtype", "bf16",
        "--reasoning-parser", "kimi_k2",
        "--max-running-requests", "512",
        "--context-length", "131072",
        "--enable-metrics",
        "--trust-remote-code", "--tool-call-parser", "kimi_k2",
    ]  # fmt: skip
    env = engine_for("sglang").env(profile)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert engine_for("sglang").url(profile) == "http://127.0.0.1:30000"


def test_vllm_golden_argv_for_the_local_cpu_example() -> None:
    profile = load_profile(EXAMPLES / "local-cpu.yaml")
    assert engine_for("vllm").argv(profile) == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        # Relative to the profile file, not to the working directory.
        "--model", str(REPO / ".cache" / "tiny-model"),
        "--served-model-name", "tiny",
        "--host", "127.0.0.1",
        "--port", "8000",
        "--tensor-parallel-size", "1",
        "--kv-cache-dtype", "bfloat16",
        "--dtype", "bfloat16",
        "--max-num-seqs", "8",
        "--max-model-len", "4096",
        "--enforce-eager", "--disable-uvicorn-access-log",
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    env = engine_for("vllm").env(profile)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # with `uni`: one process fewer
    assert profile.state_path == default_state_dir() / "local-cpu"


def test_vllm_flags_for_memory_dp_and_port_override(tmp_path: Path) -> None:
    profile = ServerProfile(
        engine="vllm", model_path="org/model", tp=4, dp=2, mem_fraction=0.9,
        reasoning_parser="deepseek_r1", python="/venv/bin/python", port=0,
    )  # fmt: skip
    argv = engine_for("vllm").argv(profile, port=8123)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for expected in [
        "--model org/model --host 127.0.0.1 --port 8123",
        "--tensor-parallel-size 4 --data-parallel-size 2",
        "--gpu-memory-utilization 0.9",
        "--kv-cache-dtype bfloat16",
        "--reasoning-parser deepseek_r1",
    ]:
        assert expected in joined
    # No served name given: the engine's own default applies.
    assert "--served-model-name" not in argv
    assert "--port 0" in " ".join(engine_for("vllm").argv(profile))


def test_relative_paths_resolve_from_the_profile_file(tmp_path: Path) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    sub = tmp_path / "profiles"
    sub.mkdir()
    path = write(sub, {"engine": "vllm", "model_path": "../models/m", "python": "../venv/bin/py",
                       "state_dir": "state"})
    profile = load_profile(path)
    assert profile.model_path == str(tmp_path / "models" / "m")
    assert profile.python == str(tmp_path / "venv" / "bin" / "py")
    assert profile.state_path == sub / "state" / "m"
    assert profile.source_file == path.resolve()


def test_hub_ids_and_bare_interpreters_are_left_alone(tmp_path: Path) -> None:
    profile = load_profile(
        write(tmp_path, {"engine": "sglang", "model_path": "moonshotai/Kimi-K2.5",
                         "python": "python3"})
    )
    assert profile.model_path == "moonshotai/Kimi-K2.5"
    assert profile.interpreter == "python3"
    assert profile.server_name == "Kimi-K2.5"


def test_env_and_args_become_strings_and_max_model_len_is_an_alias(tmp_path: Path) -> None:
    profile = load_profile(
        write(tmp_path, {"engine": "vllm", "model_path": "m", "max_model_len": 1024,
                         "env": {"VLLM_CPU_KVCACHE_SPACE": 2},
                         "extra_args": ["--num-gpu-blocks-override", 16]})
    )
    assert profile.context_length == 1024
    assert profile.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert profile.extra_args == ["--num-gpu-blocks-override", "16"]


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"engine": "vllm", "model_path": "m", "tpp": 8}, "tpp", "unknown field"),
        ({"engine": "trtllm", "model_path": "m"}, "engine", "'sglang' or 'vllm'"),
        ({"engine": "vllm"}, "model_path", "Field required"),
        ({"engine": "vllm", "model_path": "m", "tp": 0}, "tp", "greater than or equal to 1"),
        ({"engine": "vllm", "model_path": "m", "mem_fraction": 1.5}, "mem_fraction",
         "less than or equal to 1"),
        ({"engine": "vllm", "model_path": "m", "quality": {"allow_lossy": True}},
         "quality.allow_lossy", "unknown field"),
        ({"engine": "sglang", "model_path": "m", "hierarchical_cache": {"host_gb_per_rank": 8}},
         "hierarchical_cache", "enabled is false"),
        ({"engine": "vllm", "model_path": "m", "dp": 2, "dp_attention": True}, "(top level)",
         "only SGLang has data-parallel attention"),
        ({"engine": "sglang", "model_path": "m", "tp": 8, "dp": 3, "dp_attention": True},
         "(top level)", "tp divisible by dp"),
        ({"engine": "vllm", "model_path": "m", "hierarchical_cache": {"enabled": True}},
         "(top level)", "only SGLang has --enable-hierarchical-cache"),
        ({"engine": "sglang", "model_path": "m", "kv_cache_dtype": "float16"}, "(top level)",
         "no float16 choice"),
        ({"engine": "vllm", "model_path": "m", "kv_cache_dtype": "fp8 e4m3"}, "kv_cache_dtype",
         "not a dtype name"),
        # A flag the profile owns, smuggled in: --kv-cache-dtype would dodge the policy.
        ({"engine": "vllm", "model_path": "m", "extra_args": ["--kv_cache_dtype=fp8"]},
         "(top level)", "set by a profile field"),
        ({"engine": "vllm", "model_path": "m", "extra_args": ["--port", "1"]}, "(top level)",
         "use the field instead"),
        ({"engine": "vllm", "model_path": "m", "name": "a/b"}, "name", "pattern"),
    ],
)
def test_invalid_profiles_name_the_file_and_the_field(
    tmp_path: Path, data: dict[str, Any], field: str, message: str
) -> None:
    path = write(tmp_path, data)
    with pytest.raises(JobError) as excinfo:
        load_profile(path)
    text = str(excinfo.value)
    assert text.startswith(f"{path}: invalid server profile: ")
    assert "\n" not in text  # one line: the fields are joined with "; "
    assert re.search(f"{re.escape(field)}: .*{re.escape(message)}", text), text


def test_unreadable_or_malformed_files_are_job_errors(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="cannot read server profile"):
        load_profile(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [vllm\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_profile(bad)
    bad.write_text("- vllm\n")
    with pytest.raises(JobError, match="must be a mapping"):
        load_profile(bad)


def test_profile_hash_tracks_settings_not_bookkeeping(tmp_path: Path) -> None:
    base = {"engine": "sglang", "model_path": "/m", "tp": 8, "mem_fraction": 0.88}
    first = profile_hash(load_profile(write(tmp_path, base, "a.yaml")))
    assert first == profile_hash(load_profile(write(tmp_path, base, "a.yaml")))
    assert len(first) == 16
    # One dtype, two spellings; the state directory and name change no token.
    same = {**base, "kv_cache_dtype": "BF16", "state_dir": "/elsewhere", "name": "other"}
    assert profile_hash(load_profile(write(tmp_path, same, "b.yaml"))) == first
    changed = {**base, "mem_fraction": 0.9}
    assert profile_hash(load_profile(write(tmp_path, changed, "c.yaml"))) != first


def test_state_dir_defaults_to_the_user_cache(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.delenv("DRAFTGEN_SERVERS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "draftgen" / "servers"
    monkeypatch.setenv("DRAFTGEN_SERVERS_DIR", str(tmp_path / "servers"))
    profile = ServerProfile(engine="vllm", model_path="/models/Qwen3-8B/")
    assert profile.state_path == tmp_path / "servers" / "Qwen3-8B"


@pytest.mark.parametrize("engine, settings, limit", [
    ("vllm", {}, None),  # no limit set: the engine's own default, not known here
    ("vllm", {"max_running_requests": 8}, 8),
    ("vllm", {"max_running_requests": 8, "dp": 2}, 16),  # --max-num-seqs per engine core
    ("sglang", {"max_running_requests": 64, "dp": 2, "tp": 2}, 128),  # per DP worker
    # DP attention: the ranks split one limit (SGLang sizes each max_running_requests // dp).
    ("sglang", {"max_running_requests": 512, "dp": 8, "tp": 8, "dp_attention": True}, 512),
])
def test_the_running_limit_a_launched_server_runs(engine: str, settings: dict[str, Any],
                                                   limit: int | None) -> None:
    profile = ServerProfile(engine=engine, model_path="org/model", **settings)
    assert engine_for(engine).running_limit(profile) == limit

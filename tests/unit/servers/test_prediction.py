"""A profile's predicted capacity: which facts feed the memory model, and what the commands
built on it print (`serve --dry-run`, `plan --profile`, `tune --dry-run`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from draftgen.cli import app
from draftgen.engines.memory import GB, MIB, MemoryModelError
from draftgen.servers.gpu import GpuMemory
from draftgen.servers.prediction import SUMMARY_FILE, memory_facts, predict_profile
from draftgen.servers.profile import load_profile

REPO = Path(__file__).resolve().parents[3]
KIMI = REPO / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"
DEMO_JOB = REPO / "examples" / "demo" / "job-tiny.yaml"
CONFIG = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2}


def profile_at(tmp_path: Path, **fields: Any) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    data = {"engine": "vllm", "model_path": str(model), "mem_fraction": 0.5,
            "state_dir": str(tmp_path / "state"), **fields}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_facts_come_from_the_checkpoint_and_the_driver(tmp_path: Path) -> None:
    path = profile_at(tmp_path)
    model = tmp_path / "model"
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * GB}}))
    facts = memory_facts(load_profile(path), gpus=lambda: [GpuMemory(0, 24_000, 100)])
    assert facts.hardware.weights_bytes == 2 * GB
    assert "model.safetensors.index.json" in facts.hardware.weights_source
    assert facts.hardware.gpu_bytes == 24_000 * MIB
    assert facts.hardware.gpu_source == "nvidia-smi on this machine"
    assert facts.reserve_bytes == 0 and "not fitted" in facts.reserve_source
    # 24,000 MiB × 0.5 − 2 GB of weights, at 4 layers × 2 × 2 heads × 64 × 2 bytes a token.
    expected = int((24_000 * MIB * 0.5 - 2 * GB) // (4 * 2 * 2 * 64 * 2))
    assert predict_profile(load_profile(path), facts).kv_tokens == expected


def test_the_last_verify_fits_the_reserve_and_gives_the_gpu(tmp_path: Path) -> None:
    path = profile_at(tmp_path, memory={"weights_gb": 2})
    profile = load_profile(path)
    profile.state_path.mkdir(parents=True)
    (profile.state_path / SUMMARY_FILE).write_text(json.dumps({
        "info": {"kv_tokens": 100_000, "mem_fraction": 0.5, "kv_dtype": "bfloat16", "tp": 1},
        "gpus": [{"index": 0, "total_mib": 24_000, "used_mib": 20_000}]}))
    facts = memory_facts(profile, gpus=lambda: None)
    assert facts.hardware.gpu_source == "the last verify of this profile"
    assert "the last verify" in facts.reserve_source
    # Fitted to that point, the model gives it back exactly, and more for a larger fraction.
    assert predict_profile(profile, facts).kv_tokens == pytest.approx(100_000, abs=1)
    assert predict_profile(profile, facts, fraction=0.6).kv_tokens > 100_000


def test_what_is_missing_is_named_with_the_field_that_gives_it(tmp_path: Path) -> None:
    path = profile_at(tmp_path)
    with pytest.raises(MemoryModelError, match=r"memory\.weights_gb"):
        memory_facts(load_profile(path), gpus=lambda: [GpuMemory(0, 24_000, 0)])
    with pytest.raises(MemoryModelError, match=r"memory\.gpu_memory_mib"):
        memory_facts(load_profile(profile_at(tmp_path, memory={"weights_gb": 2})),
                     gpus=lambda: None)
    elsewhere = profile_at(tmp_path, model_path="org/model-on-a-hub")
    with pytest.raises(MemoryModelError, match=r"memory\.model_config"):
        memory_facts(load_profile(elsewhere), gpus=lambda: None)


def test_plan_with_a_profile_predicts_the_job_before_a_server_exists() -> None:
    result = CliRunner().invoke(app, ["plan", str(DEMO_JOB), "--profile", str(KIMI)])
    assert result.exit_code == 0, result.output
    assert "servers: 1 × 229,280 KV tokens" in result.output
    assert "fitted to 159,277 KV tokens at mem_fraction 0.88" in result.output
    assert "decode speed: the Kimi case's readings" in result.output
    assert "predicted: 205 samples" in result.output


def test_plan_refuses_a_server_and_a_profile_together() -> None:
    result = CliRunner().invoke(app, ["plan", str(DEMO_JOB), "--profile", str(KIMI),
                                      "--server", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "not both" in result.output


def test_tune_dry_run_lists_dcp_for_the_kimi_profile_with_predictions() -> None:
    result = CliRunner().invoke(app, ["tune", str(KIMI), "--job", str(DEMO_JOB),
                                      "--dry-run"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()
            if line and not line.startswith("#")}
    assert "1,274,216" in rows["dcp=8"] and "a GPU machine" in rows["dcp=8"]
    assert "229,280" in rows["reference"]
    assert "only a measurement tells" in rows["chunked_prefill=16384"]

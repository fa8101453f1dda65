"""The quality policy: lossy and `auto` KV dtypes refused with reasons, the override stamped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.cli.serve import serve
from draftgen.engines.dtypes import canonical_kv_dtype, is_lossy_kv_dtype
from draftgen.servers import (
    QualityPolicyError,
    ServerInfo,
    ServerProfile,
    check_profile,
    check_running,
    load_profile,
    profile_hash,
)

LOSSY = [
    "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "fp8_per_token_head", "fp4_e2m1",
    "mxfp8", "mxfp4", "nvfp4", "nvfp4_ds_mla", "nvfp4_4over6", "int8", "int4",
    "int8_per_token_head", "int4_per_token_head", "turboquant_k8v4", "ultraquant_4bit",
    "FP8_E4M3", "Fp8-E5M2",
    # Unknown names are refused too: a new quantized format must not slip through.
    "q3_k", "some_new_format",
]  # fmt: skip


def profile(kv: str, *, allow: bool = False, engine: str = "vllm", **extra: Any) -> ServerProfile:
    return ServerProfile.model_validate(
        {"engine": engine, "model_path": "/m", "kv_cache_dtype": kv,
         "quality": {"allow_lossy_kv_cache": allow, **extra}}
    )


def assert_explains(message: str) -> None:
    # Why, with the measured degradation and where it was measured...
    for evidence in ["0.507 → 0.493", "0.773 → 0.733", "95.3 → 76.7", "sglang#22671",
                     "vllm#38652"]:
        assert evidence in message
    # ...and the lossless levers and the one override.
    for lever in ["mem_fraction", "dp_attention", "max_running_requests", "hierarchical_cache",
                  "allow_lossy_kv_cache: true"]:
        assert lever in message


@pytest.mark.parametrize("dtype", LOSSY)
def test_every_lossy_dtype_is_refused_with_the_reason(dtype: str) -> None:
    with pytest.raises(QualityPolicyError) as excinfo:
        check_profile(profile(dtype))
    message = str(excinfo.value)
    assert f"{canonical_kv_dtype(dtype)!r}" in message
    assert_explains(message)


@pytest.mark.parametrize("allow", [False, True])
def test_auto_is_refused_even_with_the_override(allow: bool) -> None:
    with pytest.raises(QualityPolicyError) as excinfo:
        check_profile(profile("auto", allow=allow))
    message = str(excinfo.value)
    assert "'auto' is refused" in message
    assert "fp8" in message
    assert_explains(message)


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "BF16", "float16", "fp16", "float32"])
def test_full_precision_dtypes_pass_without_a_stamp(dtype: str) -> None:
    assert not is_lossy_kv_dtype(dtype)
    assert check_profile(profile(dtype)) is None


def test_the_override_returns_a_stamp_for_run_manifests() -> None:
    p = profile("fp8_e4m3", allow=True, reason="throughput test, not training data")
    stamp = check_profile(p)
    assert stamp is not None
    assert stamp["allow_lossy_kv_cache"] is True
    assert stamp["kv_cache_dtype"] == "fp8_e4m3"
    assert stamp["reason"] == "throughput test, not training data"
    assert stamp["profile_hash"] == profile_hash(p)
    assert "lossy" in stamp["warning"]


def test_the_refusal_names_the_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump({"engine": "sglang", "model_path": "/m",
                                    "kv_cache_dtype": "fp8_e4m3"}))
    with pytest.raises(QualityPolicyError, match=f"^{path}: kv_cache_dtype: 'fp8_e4m3'"):
        check_profile(load_profile(path))


def info(kv: str | None, note: str = "server_info kv_cache_dtype") -> ServerInfo:
    return ServerInfo(url="http://gpu:30000", engine="sglang", kv_dtype=kv, kv_dtype_note=note)


def test_a_running_server_with_a_lossy_cache_is_a_violation() -> None:
    with pytest.raises(QualityPolicyError) as excinfo:
        check_running(info("fp8_e4m3"))
    message = str(excinfo.value)
    assert message.startswith("policy violation: http://gpu:30000 (sglang) runs a lossy")
    assert_explains(message)
    # A profile without the override does not help.
    with pytest.raises(QualityPolicyError):
        check_running(info("fp8_e4m3"), profile("bfloat16", engine="sglang"))


def test_the_profile_override_lets_a_lossy_server_through_with_a_stamp() -> None:
    stamp = check_running(info("fp8_e4m3"), profile("fp8_e4m3", allow=True, engine="sglang"))
    assert stamp is not None
    assert stamp["server"] == "http://gpu:30000"
    assert stamp["kv_cache_dtype"] == "fp8_e4m3"


def test_an_unknown_running_dtype_is_a_violation_and_lossless_passes() -> None:
    with pytest.raises(QualityPolicyError, match="cannot tell which KV cache dtype"):
        check_running(info(None, "auto, and the model dtype could not be read"))
    assert check_running(info("bfloat16")) is None
    assert check_running(info("bf16")) is None


def write_profile(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"engine": "sglang", "model_path": "/models/m", **fields}))
    return path


def test_dry_run_of_an_fp8_profile_exits_2_with_the_explanation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(write_profile(tmp_path, kv_cache_dtype="fp8_e4m3"), dry_run=True) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert_explains(err)


def test_dry_run_of_an_auto_profile_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(write_profile(tmp_path, kv_cache_dtype="auto"), dry_run=True) == 2
    assert "'auto' is refused" in capsys.readouterr().err


def test_dry_run_of_a_bf16_profile_prints_the_argv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(write_profile(tmp_path, tp=2, port=31000), dry_run=True) == 0
    out, err = capsys.readouterr()
    first = out.splitlines()[0]
    assert "-m sglang.launch_server --model-path /models/m --host 127.0.0.1 --port 31000" in first
    assert "--tp-size 2" in first
    assert "--kv-cache-dtype bf16" in first
    assert err == ""


def test_dry_run_with_the_override_prints_the_argv_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_profile(tmp_path, kv_cache_dtype="fp8_e4m3",
                         quality={"allow_lossy_kv_cache": True})
    assert serve(path, dry_run=True) == 0
    out, err = capsys.readouterr()
    assert "--kv-cache-dtype fp8_e4m3" in out
    assert "warning: lossy KV cache fp8_e4m3 allowed" in err


def test_serve_reports_bad_profiles_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(write_profile(tmp_path, tpp=8), dry_run=True) == 2
    assert "tpp: unknown field" in capsys.readouterr().err
    # A missing profile and two modes at once are the command line's to refuse
    # (tests/unit/cli/test_bad_commands.py: serve-no-profile, serve-two-modes).

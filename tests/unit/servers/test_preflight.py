"""Preflight: host RAM for SGLang's HiCache and GPU memory, checked before a launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draftgen.servers.gpu import GpuMemory
from draftgen.servers.preflight import (
    GB,
    HICACHE_RESERVE_BYTES,
    check_gpu_memory,
    check_host_ram,
    gpu_ranks,
    preflight,
    read_available_memory,
)
from draftgen.servers.profile import ServerProfile, load_profile

KIMI = Path(__file__).resolve().parents[3] / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"


def sglang(**fields: Any) -> ServerProfile:
    return ServerProfile(engine="sglang", model_path="/m", **fields)


def test_ranks_are_the_gpus_of_the_server() -> None:
    assert gpu_ranks(load_profile(KIMI)) == 8  # tp 8, DP attention inside the TP group
    assert gpu_ranks(sglang(tp=4, dp=2)) == 8  # two replicas of 4
    assert gpu_ranks(sglang(tp=2)) == 2


def test_hicache_that_fits_passes_and_says_so() -> None:
    checked = check_host_ram(load_profile(KIMI), 600 * GB)
    assert checked.ok
    assert "64 × 8 ranks = 512 GB" in checked.checks[0] and "fits" in checked.checks[0]


def test_hicache_too_big_is_refused_with_the_largest_that_fits() -> None:
    # 24 GB available - 10 GiB reserve = 13.26 GB over 8 ranks: 1 GB each.
    checked = check_host_ram(load_profile(KIMI), 24 * GB)
    assert not checked.ok
    assert "512 GB" in checked.problems[0]
    assert "the largest that fits is host_gb_per_rank: 1" in checked.problems[0]


def test_no_pool_fits_below_the_reserve() -> None:
    checked = check_host_ram(load_profile(KIMI), HICACHE_RESERVE_BYTES + 7 * GB)
    assert "no HiCache host pool fits" in checked.problems[0]


def test_hicache_off_or_vllm_needs_no_host_ram() -> None:
    assert check_host_ram(sglang(), 1) == check_host_ram(sglang(tp=8), None)
    assert check_host_ram(sglang(), 1).ok and not check_host_ram(sglang(), 1).checks


def test_unknown_host_memory_is_said_not_guessed() -> None:
    checked = check_host_ram(load_profile(KIMI), None)
    assert checked.ok and "not checked" in checked.checks[0]


def test_available_memory_is_bounded_by_the_cgroup(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 9000 kB\nMemAvailable:    1000 kB\n")
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("500000\n")
    (cgroup / "memory.current").write_text("100000\n")
    assert read_available_memory(tmp_path) == 400_000
    (cgroup / "memory.max").write_text("max\n")
    assert read_available_memory(tmp_path) == 1_024_000


@pytest.mark.parametrize("used_gib, ok", [(0, True), (20, False)])
def test_gpu_memory_held_by_others_refuses_the_fraction(used_gib: int, ok: bool) -> None:
    gpus = [GpuMemory(0, 81920, 0), GpuMemory(1, 81920, used_gib * 1024)]
    checked = check_gpu_memory(sglang(mem_fraction=0.88), gpus)
    assert checked.ok is ok
    if not ok:
        assert "GPU 1 60.0 of 80.0 GiB free" in checked.problems[0]
        assert "the largest that fits is mem_fraction: 0.75" in checked.problems[0]


def test_preflight_gathers_both_checks() -> None:
    checked = preflight(load_profile(KIMI), available_bytes=lambda: 24 * GB,
                        gpus=lambda: [GpuMemory(0, 81920, 0)])
    assert len(checked.problems) == 1 and "host_gb_per_rank: 1" in checked.problems[0]
    assert any("mem_fraction 0.88 fits" in c for c in checked.checks)


@pytest.mark.parametrize("available_gb, fits", [(600, True), (24, False)])
def test_serve_dry_run_shows_dp_flags_and_the_preflight(monkeypatch: pytest.MonkeyPatch,
                                                        available_gb: int, fits: bool) -> None:
    from typer.testing import CliRunner

    from draftgen.cli import app
    from draftgen.servers import preflight as preflight_module

    monkeypatch.setattr(preflight_module, "read_available_memory", lambda: available_gb * GB)
    result = CliRunner().invoke(app, ["serve", str(KIMI), "--dry-run"])
    # A dry run checks a profile, perhaps for another machine: what this one lacks is
    # reported beside the argv, never fatal.
    assert result.exit_code == 0, result.output
    assert "# predicted KV tokens: " in result.output
    # SGLang is not installed for this interpreter: the newest release's DP flag.
    assert "--attn-dp-size 8" in result.output and "--enable-dp-attention" not in result.output
    assert "# engine: sglang not found" in result.output
    if fits:
        assert "# preflight: hierarchical_cache.host_gb_per_rank 64 × 8 ranks" in result.output
    else:
        assert "# preflight would refuse this on this machine: hierarchical_cache" \
            in result.output
        assert "the largest that fits is host_gb_per_rank: 1" in result.output

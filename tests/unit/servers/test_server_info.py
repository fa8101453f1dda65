"""What a running server reports: SGLang against a stand-in that answers like SGLang, vLLM
against its captured /metrics, GPU headroom from captured nvidia-smi text, and the summary."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from draftgen.servers import (
    QualityPolicyError,
    ServerInfo,
    ServerInfoError,
    ServerProfile,
    capacity_change,
    check_health,
    check_running,
    fetch_server_info,
    manifest_record,
    profile_hash,
    summary_line,
)
from draftgen.servers.gpu import (
    GpuMemory,
    min_headroom_gib,
    parse_nvidia_smi,
    read_gpu_memory,
    visible_indices,
)
from draftgen.servers.process import find_free_port
from helpers.sglang_standin import StandinConfig, start_standin

Standin = Callable[[StandinConfig], Any]


@pytest.fixture
async def standin() -> AsyncIterator[Callable[[StandinConfig], Any]]:
    runners: list[web.AppRunner] = []

    async def start(cfg: StandinConfig) -> str:
        runner, url = await start_standin(cfg)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_sglang_info_per_dp_rank_from_v1_loads(standin: Standin) -> None:
    cfg = StandinConfig(tp_size=8, dp_size=4, enable_dp_attention=True, mem_fraction_static=0.88,
                        max_running_requests=512, context_length=131072, rank_jitter=7,
                        enable_hierarchical_cache=True, hicache_size=64)
    url = await standin(cfg)
    info = await fetch_server_info(url)
    assert info.engine == "sglang"
    assert info.version == "0.5.9"
    assert info.model == "kimi-k2.5"
    assert info.model_path == "/models/Kimi-K2.5"
    assert info.kv_tokens_per_rank == (176_000, 175_993, 175_986, 175_979)
    assert info.kv_tokens == sum(info.kv_tokens_per_rank)
    assert (info.kv_dtype, info.kv_dtype_setting) == ("bfloat16", "bf16")
    assert info.kv_dtype_note == "server_info kv_cache_dtype"
    assert info.max_running_requests == 512  # 4 ranks × 128
    assert info.mem_fraction == 0.88
    assert info.context_length == 131072
    assert (info.tp, info.dp) == (8, 4)
    assert info.args["enable_hierarchical_cache"] is True
    assert info.args["hicache_size"] == 64
    assert info.args["max_total_num_tokens"] == 176_000
    assert "/server_info" in cfg.seen and "/get_server_info" not in cfg.seen


async def test_older_sglang_falls_back_to_get_server_info_and_internal_states(
    standin: Standin,
) -> None:
    cfg = StandinConfig(dp_size=2, old_api=True, rank_jitter=5, version="0.4.6")
    info = await fetch_server_info(await standin(cfg))
    assert cfg.seen[:2] == ["/server_info", "/get_server_info"]
    assert info.version == "0.4.6"
    assert info.kv_tokens_per_rank == (176_000, 175_995)
    # No context_length argument: the served model's max_model_len.
    assert info.context_length == 131072


async def test_oldest_sglang_capacity_is_rank_zero_times_dp(standin: Standin) -> None:
    cfg = StandinConfig(dp_size=4, old_api=True, states_have_capacity=False, rank_jitter=5)
    info = await fetch_server_info(await standin(cfg))
    assert info.kv_tokens_per_rank == (176_000,) * 4
    assert info.kv_tokens == 704_000


async def test_sglang_auto_dtype_resolves_from_the_model_folder(
    standin: Standin, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    info = await fetch_server_info(
        await standin(StandinConfig(model_path=str(model), kv_cache_dtype="auto"))
    )
    assert info.kv_dtype == "bfloat16"
    assert info.kv_dtype_setting == "auto"
    assert f"config.json of {model}" in info.kv_dtype_note
    assert check_running(info) is None

    # The same `auto` on a checkpoint declaring an fp8 KV scheme: what the policy exists for.
    (model / "config.json").write_text(json.dumps(
        {"torch_dtype": "bfloat16",
         "quantization_config": {"quant_method": "compressed-tensors",
                                 "kv_cache_scheme": {"num_bits": 8, "type": "float"}}}))
    info = await fetch_server_info(
        await standin(StandinConfig(model_path=str(model), kv_cache_dtype="auto"))
    )
    assert info.kv_dtype == "fp8"
    assert "kv_cache_scheme" in info.kv_dtype_note
    with pytest.raises(QualityPolicyError, match="runs a lossy KV cache: fp8"):
        check_running(info)


async def test_sglang_auto_on_a_model_elsewhere_cannot_be_verified(standin: Standin) -> None:
    info = await fetch_server_info(await standin(StandinConfig(kv_cache_dtype="auto")))
    assert info.kv_dtype is None
    with pytest.raises(QualityPolicyError, match="cannot tell"):
        check_running(info)


async def test_sglang_fp8_server_is_a_violation(standin: Standin) -> None:
    info = await fetch_server_info(await standin(StandinConfig(kv_cache_dtype="fp8_e4m3")))
    assert info.kv_dtype == "fp8_e4m3"
    assert info.kv_tokens == 352_000  # double the bf16 capacity
    with pytest.raises(QualityPolicyError, match="policy violation"):
        check_running(info)


async def test_health_is_503_while_starting_then_200(standin: Standin) -> None:
    url = await standin(StandinConfig(starting_polls=2))
    async with aiohttp.ClientSession() as session:
        assert not await check_health(session, url)
        assert not await check_health(session, url, path="/health_generate")
        assert await check_health(session, url)
        assert await check_health(url, path="/health_generate")
    assert not await check_health(f"http://127.0.0.1:{find_free_port()}")


async def test_v1_loads_entries_are_ordered_by_rank(standin: Standin) -> None:
    from draftgen.engines.sglang.info import rank_loads

    url = await standin(StandinConfig(dp_size=3))
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/loads") as r:
        body = await r.json()
    assert [e["dp_rank"] for e in body["loads"]] == [2, 1, 0]
    assert [e["dp_rank"] for e in rank_loads(body)] == [0, 1, 2]
    assert [e["dp_rank"] for e in rank_loads(body["loads"])] == [0, 1, 2]
    assert rank_loads({"error": "x"}) == []


# vLLM 0.32.0 (CPU) with --num-gpu-blocks-override 16 --kv-cache-dtype bfloat16, captured.
VLLM_CACHE_INFO = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="{dtype}",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="128",'
    'enable_prefix_caching="True",engine="{engine}",gpu_memory_utilization="0.92",'
    'is_attention_free="False",kv_cache_max_concurrency="2.0",'
    'kv_cache_memory_bytes="1073741824",{size}kv_offloading_backend="native",'
    'num_cpu_blocks="None",num_gpu_blocks="16",num_gpu_blocks_override="16",'
    'sliding_window="None",user_specified_block_size="False"} 1.0'
)


def vllm_metrics(dtype: str = "bfloat16", engines: Sequence[int] = (0,), size: bool = True
                 ) -> str:
    head = ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge"]
    lines = [
        VLLM_CACHE_INFO.replace("{dtype}", dtype).replace("{engine}", str(e))
        .replace("{size}", 'kv_cache_size_tokens="2048",' if size else "")
        for e in engines
    ]
    usage = ["# HELP vllm:kv_cache_usage_perc KV-cache usage.",
             "# TYPE vllm:kv_cache_usage_perc gauge",
             'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0']
    return "\n".join([*head, *lines, *usage]) + "\n"


async def vllm_standin(metrics: str, root: str) -> tuple[web.AppRunner, str]:
    async def text(_: web.Request) -> web.Response:
        return web.Response(text=metrics, content_type="text/plain")

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "owned_by": "vllm", "root": root,
             "parent": None, "max_model_len": 1024}]})

    app = web.Application()
    app.router.add_get("/metrics", text)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_vllm_info_from_cache_config_info() -> None:
    runner, url = await vllm_standin(vllm_metrics(), "/models/tiny")
    try:
        info = await fetch_server_info(url)
    finally:
        await runner.cleanup()
    assert info.engine == "vllm"
    assert info.version == "0.32.0"
    assert (info.model, info.model_path) == ("tiny", "/models/tiny")
    assert info.kv_tokens == 2048
    assert info.kv_tokens_per_rank == (2048,)
    assert info.kv_dtype == "bfloat16"
    assert info.kv_dtype_note == "vllm:cache_config_info cache_dtype"
    assert info.mem_fraction == 0.92
    assert info.context_length == 1024
    assert info.dp == 1
    assert info.args["num_gpu_blocks"] == "16"


async def test_vllm_older_release_capacity_is_blocks_times_block_size_per_engine() -> None:
    runner, url = await vllm_standin(vllm_metrics(engines=(1, 0), size=False), "/models/tiny")
    try:
        info = await fetch_server_info(url)
    finally:
        await runner.cleanup()
    assert info.kv_tokens_per_rank == (2048, 2048)
    assert info.kv_tokens == 4096
    assert info.dp == 2


async def test_vllm_auto_is_resolved_from_the_profile_or_the_model_folder(
    tmp_path: Path,
) -> None:
    runner, url = await vllm_standin(vllm_metrics("auto"), str(tmp_path))
    try:
        launched = ServerProfile(engine="vllm", model_path=str(tmp_path), model_dtype="bfloat16")
        info = await fetch_server_info(url, profile=launched)
        assert (info.kv_dtype, info.kv_dtype_setting) == ("bfloat16", "auto")
        assert "launch profile" in info.kv_dtype_note
        # No profile, no readable config.json: unknown, and so a violation.
        info = await fetch_server_info(url)
        assert info.kv_dtype is None
        (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
        info = await fetch_server_info(url)
        assert info.kv_dtype == "float16"
    finally:
        await runner.cleanup()


async def test_a_url_that_is_neither_engine_or_unreachable_is_an_error() -> None:
    runner, url = await vllm_standin("# nothing\n", "/m")
    try:
        with pytest.raises(ServerInfoError, match="does not answer like sglang or vllm"):
            await fetch_server_info(url)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ServerInfoError, match="does not answer like sglang"):
                await fetch_server_info(session, url, engine="sglang")
    finally:
        await runner.cleanup()
    with pytest.raises(ServerInfoError, match="ClientConnectorError"):
        await fetch_server_info(f"http://127.0.0.1:{find_free_port()}")


# nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv,noheader,nounits on an
# 8×H200 node running SGLang at --mem-fraction-static 0.88; GPU 7 is a MIG slice.
NVIDIA_SMI = """\
0, 143771, 138168
1, 143771, 138170
2, 143771, 138166
3, 143771, 138170
4, 143771, 138170
5, 143771, 138170
6, 143771, 137998
7, [N/A], [N/A]
"""


def test_nvidia_smi_rows_parse_and_the_minimum_headroom_is_found() -> None:
    gpus = parse_nvidia_smi(NVIDIA_SMI)
    assert [g.index for g in gpus] == list(range(7))
    assert gpus[0] == GpuMemory(0, 143771, 138168)
    assert gpus[0].free_mib == 5603
    assert min_headroom_gib(gpus) == pytest.approx(5601 / 1024)
    assert gpus[6].to_json()["headroom_gib"] == 5.64
    assert min_headroom_gib([]) is None


def test_read_gpu_memory_runs_nvidia_smi_only_where_it_exists() -> None:
    calls: list[Sequence[str]] = []

    def run(argv: Sequence[str]) -> str:
        calls.append(argv)
        return NVIDIA_SMI

    assert read_gpu_memory(run=run, which=lambda _: None) is None
    assert calls == []
    gpus = read_gpu_memory(run=run, which=lambda _: "/usr/bin/nvidia-smi", only={1, 6})
    assert gpus is not None and [g.index for g in gpus] == [1, 6]
    assert calls[0][1:] == ["--query-gpu=index,memory.total,memory.used",
                            "--format=csv,noheader,nounits"]
    assert visible_indices({"CUDA_VISIBLE_DEVICES": "0,1, 6"}) == {0, 1, 6}
    assert visible_indices({"CUDA_VISIBLE_DEVICES": "GPU-3f2a"}) is None
    assert visible_indices({}) is None


def sglang_info(**kw: Any) -> ServerInfo:
    base: dict[str, Any] = dict(url="http://gpu:30000", engine="sglang", kv_dtype="bfloat16",
                                kv_tokens=159_277, kv_tokens_per_rank=(159_277,))
    return ServerInfo(**{**base, **kw})


def test_summary_line_reads_like_the_issue() -> None:
    gpus = [GpuMemory(0, 143771, 138170), GpuMemory(1, 143771, 138168)]
    assert summary_line(sglang_info(), gpus) == (
        "up — 159,277 KV tokens, bf16 KV, 5.47 GiB headroom/GPU (min)"
    )
    dp = sglang_info(kv_tokens=637_108, kv_tokens_per_rank=(159_277,) * 4)
    assert summary_line(dp) == "up — 637,108 KV tokens (4 ranks × 159,277), bf16 KV"
    odd = sglang_info(kv_tokens=300, kv_tokens_per_rank=(100, 200), kv_dtype="fp8_e4m3")
    assert summary_line(odd, None, {"allow_lossy_kv_cache": True}) == (
        "up — 300 KV tokens (100 + 200), fp8_e4m3 KV, "
        "LOSSY KV CACHE allowed by the profile's quality override"
    )
    assert summary_line(sglang_info(kv_tokens=None, kv_dtype=None)) == (
        "up — KV capacity not reported, KV dtype unknown"
    )


def test_capacity_change_lists_what_a_restart_changed() -> None:
    before = sglang_info(kv_tokens=2048, mem_fraction=0.8)
    after = sglang_info(kv_tokens=4096, mem_fraction=0.9)
    assert capacity_change(before, after) == (
        "KV tokens: 2,048 → 4,096 (+2,048, ×2.00)\nmemory fraction: 0.8 → 0.9"
    )
    assert capacity_change(before, before) == "no change in capacity or settings"
    assert capacity_change(None, after) == "no earlier server to compare with"


def test_manifest_record_and_identity_round_trip() -> None:
    profile = ServerProfile(engine="sglang", model_path="/m")
    info = sglang_info(version="0.5.9", args={"tp_size": 8})
    record = manifest_record(info, profile=profile, quality_stamp=None)
    assert record["profile_hash"] == profile_hash(profile)
    assert record["kv_tokens"] == 159_277
    assert record["kv_dtype"] == "bfloat16"
    assert record["quality_override"] is None
    assert ServerInfo.from_json(json.loads(json.dumps(info.to_json()))) == info
    assert info.identity() != sglang_info(version="0.5.9", kv_tokens=1).identity()
    assert "url" not in info.identity()

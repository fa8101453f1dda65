"""LoadPoller against a stand-in server replaying what SGLang and vLLM publish."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from draftgen.client.load import LoadPoller
from draftgen.clock import FakeClock
from draftgen.engines.load import FIELDS, ServerLoad
from draftgen.engines.registry import read_metrics
from draftgen.engines.sglang.load import info_capacity as read_server_info
from draftgen.engines.sglang.load import read_loads as read_sglang_loads
from draftgen.local import find_free_port


def read_prometheus(text: str) -> tuple[dict[str, float], str | None]:
    """A Prometheus page's load fields and the name of the engine whose names it uses."""
    reading, engine = read_metrics(text)
    return reading, None if engine is None else engine.name


# From a real vLLM 0.32 CPU engine (LocalEngine, --num-gpu-blocks-override 16,
# --max-model-len 1024) under 24 streaming requests, trimmed to a few families. The
# histogram, `_created` and `..._by_reason` lines are there to be ignored.
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 13220.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.6666666666666667
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 22.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7962308409824107e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 7000.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"} 0.0
vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="tiny"} 785.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="tiny"} 995.0
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 995.0
vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 7266.0
# HELP vllm:request_num_preemptions Histogram of the number of times a request was preempted.
# TYPE vllm:request_num_preemptions histogram
vllm:request_num_preemptions_bucket{engine="0",le="1.0",model_name="tiny"} 11.0
vllm:request_num_preemptions_bucket{engine="0",le="+Inf",model_name="tiny"} 15.0
vllm:request_num_preemptions_count{engine="0",model_name="tiny"} 15.0
vllm:request_num_preemptions_sum{engine="0",model_name="tiny"} 15.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",\
cache_hit_alignment_tokens="None",effective_attention_block_size="128",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",\
kv_cache_max_concurrency="2.0",kv_cache_memory_bytes="1073741824",\
kv_cache_size_tokens="2048",num_cpu_blocks="None",num_gpu_blocks="16",\
num_gpu_blocks_override="16",sliding_window="None"} 1.0
"""

# SGLang 0.5.x /metrics with DP attention (dp 2, tp 4) and metrics from every scheduler:
# the TP ranks of one DP rank repeat its gauges. The tokenizer's counters carry no rank.
_SG = 'engine_type="unified",model_name="kimi",pp_rank="0"'
SGLANG_METRICS = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{dp_rank="0",{_SG},tp_rank="0"}} 12.0
sglang:num_running_reqs{{dp_rank="0",{_SG},tp_rank="1"}} 12.0
sglang:num_running_reqs{{dp_rank="1",{_SG},tp_rank="2"}} 9.0
sglang:num_running_reqs{{dp_rank="1",{_SG},tp_rank="3"}} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{dp_rank="0",{_SG},tp_rank="0"}} 3.0
sglang:num_queue_reqs{{dp_rank="0",{_SG},tp_rank="1"}} 3.0
sglang:num_queue_reqs{{dp_rank="1",{_SG},tp_rank="2"}} 1.0
sglang:num_queue_reqs{{dp_rank="1",{_SG},tp_rank="3"}} 1.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{dp_rank="0",{_SG},tp_rank="0"}} 61000.0
sglang:num_used_tokens{{dp_rank="1",{_SG},tp_rank="2"}} 52000.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{dp_rank="0",{_SG},tp_rank="0"}} 0.61
sglang:token_usage{{dp_rank="1",{_SG},tp_rank="2"}} 0.52
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{{dp_rank="0",{_SG},tp_rank="0"}} 100000.0
sglang:max_total_num_tokens{{dp_rank="0",{_SG},tp_rank="1"}} 100000.0
sglang:max_total_num_tokens{{dp_rank="1",{_SG},tp_rank="2"}} 100000.0
# HELP sglang:num_retracted_reqs The number of retracted requests.
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{{dp_rank="0",{_SG},pid="311",tp_rank="0"}} 4.0
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{{dp_rank="0",{_SG},tp_rank="0"}} 5.0
sglang:num_retracted_requests_total{{dp_rank="1",{_SG},tp_rank="2"}} 2.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="kimi"}} 123456.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="kimi"}} 10.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="kimi"}} 30.0
sglang:time_to_first_token_seconds_count{{model_name="kimi"}} 30.0
sglang:time_to_first_token_seconds_sum{{model_name="kimi"}} 12.5
"""


def sglang_loads(*ranks: tuple[int, int, int, int, float]) -> dict[str, Any]:
    """A /v1/loads answer; each rank is (running, waiting, used, capacity, usage)."""
    return {
        "timestamp": "2026-02-13T09:29:37.123456+00:00",
        "version": "0.5.9",
        "accelerator": "NVIDIA H200",
        "num_accelerators": 4,
        "loads": [
            {
                "dp_rank": i, "timestamp": 1770974977.1,
                "num_running_reqs": run, "num_waiting_reqs": wait,
                "num_used_tokens": used, "num_total_tokens": used + 900,
                "max_total_num_tokens": cap, "token_usage": usage,
                "gen_throughput": 1510.4, "cache_hit_rate": 0.31, "utilization": 0.93,
                "max_running_requests": 256,
                "memory": {"weight_gb": 74.1, "kv_cache_gb": 41.5, "graph_gb": 1.2,
                           "token_capacity": cap},
                "queues": {"waiting": wait, "grammar": 0, "paused": 0, "retracted": 1},
            }
            for i, (run, wait, used, cap, usage) in enumerate(ranks)
        ],
    }


TWO_RANKS = sglang_loads((12, 3, 60000, 100000, 0.6), (9, 1, 10000, 50000, 0.2))


@dataclass
class Route:
    status: int = 200
    body: str | bytes | dict[str, Any] = ""
    hang: bool = False


@dataclass
class StandIn:
    """GET only; a path without a route answers 404, like an engine without that endpoint."""

    routes: dict[str, Route] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)
    accept: dict[str, str] = field(default_factory=dict)
    port: int = 0
    _runner: web.AppRunner | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        self.accept[request.path] = request.headers.get("Accept", "")
        route = self.routes.get(request.path)
        if route is None:
            return web.Response(status=404, text='{"detail":"Not Found"}')
        if route.hang:
            await self._closing.wait()
        if isinstance(route.body, dict):
            return web.Response(status=route.status, body=orjson.dumps(route.body),
                                content_type="application/json")
        body = route.body.encode() if isinstance(route.body, str) else route.body
        return web.Response(status=route.status, body=body, content_type="text/plain")


@pytest.fixture
async def server() -> AsyncIterator[StandIn]:
    s = StandIn()
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # The chat client's session asks for event streams by default; the poller must not.
    async with aiohttp.ClientSession(headers={"Accept": "text/event-stream"}) as s:
        yield s


def poller(session: aiohttp.ClientSession, server: StandIn, *, logs: list[str] | None = None,
           clock: FakeClock | None = None, timeout_s: float = 5.0) -> LoadPoller:
    return LoadPoller(session, server.url, clock=clock or FakeClock(), timeout_s=timeout_s,
                      log=None if logs is None else logs.append)


async def test_sglang_v1_loads_sums_dp_ranks_and_weights_usage_by_capacity(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/v1/loads"] = Route(body=TWO_RANKS)
    clock = FakeClock(100.0)
    load = await poller(session, server, clock=clock).poll()
    assert load is not None
    assert (load.running, load.waiting) == (21, 4)
    assert (load.kv_used_tokens, load.kv_capacity_tokens) == (70000, 150000)
    # The capacity-weighted mean, not the plain mean of 0.6 and 0.2.
    assert load.kv_usage == pytest.approx(70000 / 150000)
    assert load.max_running == 2 * 256  # each DP rank runs up to its own limit
    assert load.at == 100.0
    assert load.source == "sglang /v1/loads"
    # queues.retracted is a gauge of the last retraction, not a counter: not reported.
    assert load.preemptions_total is None
    assert load.missing == ("preemptions_total", "generation_tokens_total",
                            "engine_steps_total")


async def test_sglang_v1_loads_takes_counters_from_metrics_when_enabled(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/v1/loads"] = Route(body=TWO_RANKS)
    server.routes["/metrics"] = Route(body=SGLANG_METRICS)
    p = poller(session, server)
    for _ in range(3):
        load = await p.poll()
        assert load is not None
        assert load.source == "sglang /v1/loads + /metrics"
        # Gauges from /v1/loads, counters from /metrics.
        assert (load.running, load.kv_capacity_tokens) == (21, 150000)
        assert (load.preemptions_total, load.generation_tokens_total) == (7, 123456)
        assert load.missing == ("engine_steps_total",)
    # Detection asked /v1/loads and /metrics once; each poll then asks both once.
    assert server.hits.count("/v1/loads") == 4
    assert server.hits.count("/metrics") == 4


async def test_sglang_v1_loads_reading_survives_a_hung_metrics_endpoint(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/v1/loads"] = Route(body=TWO_RANKS)
    server.routes["/metrics"] = Route(body=SGLANG_METRICS)
    p = poller(session, server, timeout_s=0.2)
    assert await p.poll() is not None
    server.routes["/metrics"] = Route(hang=True)
    load = await p.poll()
    assert load is not None
    assert load.source == "sglang /v1/loads"
    assert load.running == 21 and load.preemptions_total is None


async def test_sglang_metrics_dedupes_tp_ranks_and_sums_dp_ranks(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/metrics"] = Route(body=SGLANG_METRICS)
    load = await poller(session, server).poll()
    assert load is not None
    assert load.source == "sglang /metrics"
    assert (load.running, load.waiting) == (21, 4)
    assert (load.kv_used_tokens, load.kv_capacity_tokens) == (113000, 200000)
    assert load.kv_usage == pytest.approx(0.565)
    assert (load.preemptions_total, load.generation_tokens_total) == (7, 123456)
    assert load.engine_steps_total is None
    assert load.missing == ("engine_steps_total",)


async def test_sglang_metrics_without_capacity_asks_server_info_once(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    page = "\n".join(line for line in SGLANG_METRICS.splitlines()
                     if "max_total_num_tokens" not in line)
    server.routes["/metrics"] = Route(body=page + "\n")
    server.routes["/server_info"] = Route(
        body={"max_total_num_tokens": 90000, "dp_size": 2, "tp_size": 4, "kv_cache_dtype": "auto"}
    )
    p = poller(session, server)
    for _ in range(3):
        load = await p.poll()
        assert load is not None
        assert load.source == "sglang /metrics + /server_info"
        # /server_info gives capacity per DP rank.
        assert load.kv_capacity_tokens == 180000
        assert load.kv_usage == pytest.approx(0.565)
    assert server.hits.count("/server_info") == 1


async def test_sglang_server_info_alone_gives_capacity_only(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/get_server_info"] = Route(
        # Each rank's pool is `memory_usage.token_capacity` (no release has a
        # `max_total_num_tokens` of its own in internal_states).
        body={"internal_states": [{"memory_usage": {"token_capacity": 5000}},
                                  {"memory_usage": {"token_capacity": 7000}}],
              "max_total_num_tokens": 5000, "dp_size": 2}
    )
    logs: list[str] = []
    load = await poller(session, server, logs=logs).poll()
    assert load is not None
    assert load.source == "sglang /server_info"
    assert load.kv_capacity_tokens == 12000
    assert load.missing == tuple(f for f in FIELDS if f != "kv_capacity_tokens")
    assert any("lacks kv_used_tokens, kv_usage, running" in m for m in logs)


async def test_vllm_metrics_from_a_real_engine_page(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/metrics"] = Route(body=VLLM_METRICS)
    load = await poller(session, server).poll()
    assert load is not None
    assert load.kv_usage == pytest.approx(2 / 3)
    assert load == ServerLoad(
        url=server.url, at=0.0, kv_capacity_tokens=2048, kv_used_tokens=1365,
        kv_usage=load.kv_usage, running=3, waiting=7, preemptions_total=22,
        generation_tokens_total=7000, engine_steps_total=995, source="vllm /metrics",
        missing=(), kv_block_tokens=128,
    )
    assert server.hits == ["/v1/loads", "/metrics", "/metrics"]
    assert server.accept["/metrics"] == "text/plain"


def engine_page(engine: str, *, running: int, usage: float, blocks: int, preempted: int) -> str:
    labels = f'engine="{engine}",model_name="m"'
    return (
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        f"vllm:num_requests_waiting{{{labels}}} 1\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
        f"vllm:num_preemptions_total{{{labels}}} {preempted}\n"
        f"vllm:generation_tokens_total{{{labels}}} 100\n"
        f"vllm:iteration_tokens_total_count{{{labels}}} 10\n"
        f'vllm:cache_config_info{{block_size="16",{labels},num_gpu_blocks="{blocks}"}} 1.0\n'
    )


def test_vllm_data_parallel_engines_are_summed_and_paired() -> None:
    page = (engine_page("0", running=4, usage=0.5, blocks=100, preempted=2)
            + engine_page("1", running=6, usage=0.25, blocks=300, preempted=3))
    reading, engine = read_prometheus(page)
    assert engine == "vllm"
    assert reading["kv_capacity_tokens"] == 6400
    # 0.5 × 1600 + 0.25 × 4800, not the mean usage times the total.
    assert reading["kv_used_tokens"] == 2000
    assert reading["kv_usage"] == pytest.approx(2000 / 6400)
    assert (reading["running"], reading["waiting"], reading["preemptions_total"]) == (10, 2, 5)
    assert (reading["generation_tokens_total"], reading["engine_steps_total"]) == (200, 20)


def test_older_vllm_cache_info_and_usage_names() -> None:
    page = (
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{model_name="m"} 9.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="1000"} 1.0\n'
    )
    reading, _ = read_prometheus(page)
    assert reading["preemptions_total"] == 9
    assert reading["kv_capacity_tokens"] == 16000
    assert reading["kv_used_tokens"] == 4000


def test_full_real_page_and_filtered_page_read_the_same() -> None:
    # The counter family is declared with its `_total`; the parser renames such families,
    # so the poller reads sample names, which keep it.
    assert read_prometheus(VLLM_METRICS)[0]["preemptions_total"] == 22
    assert read_prometheus("vllm:num_preemptions_total 3\n")[0]["preemptions_total"] == 3


async def test_missing_vllm_capacity_is_named_and_said_once(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    page = "\n".join(line for line in VLLM_METRICS.splitlines()
                     if "cache_config_info" not in line and "num_preemptions_total" not in line)
    server.routes["/metrics"] = Route(body=page + "\n")
    logs: list[str] = []
    p = poller(session, server, logs=logs)
    for _ in range(5):
        load = await p.poll()
        assert load is not None
        assert load.kv_usage == pytest.approx(2 / 3)
        assert load.kv_capacity_tokens is None and load.kv_used_tokens is None
        assert load.missing == ("kv_capacity_tokens", "kv_used_tokens", "preemptions_total")
    assert logs == [
        f"{server.url}: load from vllm /metrics",
        f"{server.url}: load from vllm /metrics lacks kv_capacity_tokens, kv_used_tokens, "
        "preemptions_total",
    ]
    # A different set of missing fields is news; the same set again is not.
    server.routes["/metrics"] = Route(body=VLLM_METRICS)
    assert (await p.poll()) is not None
    server.routes["/metrics"] = Route(body="vllm:num_requests_running 1\n")
    for _ in range(3):
        assert (await p.poll()) is not None
    assert len(logs) == 3
    assert logs[-1].endswith("lacks kv_capacity_tokens, kv_used_tokens, kv_usage, waiting, "
                             "preemptions_total, generation_tokens_total, engine_steps_total")


async def test_nothing_listening_is_none(session: aiohttp.ClientSession) -> None:
    p = LoadPoller(session, f"http://127.0.0.1:{find_free_port()}", clock=FakeClock())
    assert await p.poll() is None
    assert p.source is None


async def test_a_hung_server_is_none_after_the_timeout(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/metrics"] = Route(body=VLLM_METRICS)
    p = poller(session, server, timeout_s=0.2)
    assert await p.poll() is not None
    server.routes["/metrics"] = Route(hang=True)
    assert await p.poll() is None


async def test_down_then_back_reads_again_without_detecting_anew(
    session: aiohttp.ClientSession,
) -> None:
    server = StandIn(routes={"/metrics": Route(body=VLLM_METRICS)})
    await server.start()
    p = poller(session, server)
    try:
        assert await p.poll() is not None
        await server.stop()
        assert await p.poll() is None
        again = StandIn(routes={"/metrics": Route(body=VLLM_METRICS)}, port=server.port)
        await again.start()
        try:
            load = await p.poll()
            assert load is not None and load.running == 3
            assert again.hits == ["/metrics"]
        finally:
            await again.stop()
    finally:
        await server.stop()


async def test_http_errors_and_garbage_give_an_empty_reading_not_an_exception(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/metrics"] = Route(body=VLLM_METRICS)
    p = poller(session, server)
    assert await p.poll() is not None
    server.routes["/metrics"] = Route(status=500, body="Internal Server Error")
    load = await p.poll()
    assert load is not None
    assert load.source == "vllm /metrics (HTTP 500)"
    assert load.missing == FIELDS
    server.routes["/metrics"] = Route(body='vllm:num_requests_running{engine="0" 3\n')
    load = await p.poll()
    assert load is not None and load.missing == FIELDS


def test_malformed_loads_are_not_sglang() -> None:
    assert read_sglang_loads({"detail": "Not Found"}) is None
    assert read_sglang_loads(None) is None
    # A rank that lacks a field leaves the sum unknown rather than undercounted.
    reading = read_sglang_loads({"loads": [{"num_running_reqs": 2}, {"num_waiting_reqs": 1}]})
    assert reading == {}
    assert read_server_info({"dp_size": 2}) is None


async def test_a_server_that_changes_engine_is_detected_again(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/v1/loads"] = Route(body=TWO_RANKS)
    p = poller(session, server)
    first = await p.poll()
    assert first is not None and first.source == "sglang /v1/loads"
    del server.routes["/v1/loads"]
    server.routes["/metrics"] = Route(body=VLLM_METRICS)
    load = await p.poll()
    assert load is not None and load.source == "vllm /metrics" and load.running == 3


async def test_sglang_starting_up_is_asked_again_until_v1_loads_answers(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    server.routes["/v1/loads"] = Route(status=503, body="starting")
    server.routes["/server_info"] = Route(body={"max_total_num_tokens": 1000, "dp_size": 1})
    p = poller(session, server)
    load = await p.poll()
    assert load is not None and load.source == "sglang /server_info"
    server.routes["/v1/loads"] = Route(body=TWO_RANKS)
    load = await p.poll()
    assert load is not None and load.source == "sglang /v1/loads"
    hits = len(server.hits)
    await p.poll()
    assert server.hits[hits:] == ["/v1/loads"]


async def test_no_load_endpoint_is_a_reading_with_everything_missing(
    server: StandIn, session: aiohttp.ClientSession
) -> None:
    logs: list[str] = []
    p = poller(session, server, logs=logs)
    for _ in range(2):
        load = await p.poll()
        assert load is not None
        assert load.source == "no load endpoint" and load.missing == FIELDS
    assert len(logs) == 2  # which endpoint (none), and what is missing (all): once each


def test_sglang_0_5_23_token_counters_split_by_streaming_are_summed() -> None:
    # 0.5.23 counts streamed and plain requests in two series; TP ranks repeat each one.
    text = "\n".join([
        "# TYPE sglang:generation_tokens_total counter",
        *(f'sglang:generation_tokens_total{{is_streaming="{s}",model_name="m",tp_rank="{t}"}} '
          f"{v}" for s, v in (("true", 10.0), ("false", 5.0)) for t in (0, 1)),
    ]) + "\n"
    reading, engine = read_prometheus(text)
    assert engine == "sglang" and reading["generation_tokens_total"] == 15.0

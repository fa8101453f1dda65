"""A gateway's worker that only the gateway reaches: its load polled from the gateway's
/engine_metrics (one read per round for all its workers), its settings verified from what
the gateway relays, and never abandoned for a port of its own that does not answer.

The gateway here is an in-process stand-in answering with the recorded smg 1.13.0 page
(tests/unit/gateways/data); the worker URLs in it lead nowhere."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from test_runner import make_job, rows

from draftgen.clock import FakeClock
from draftgen.engines.registry import read_metrics
from draftgen.gateways.load import FRESH_S, GatewayLoads, RelayedPoller
from draftgen.gateways.smg.api import ROUTED_WORKER_HEADER, ROUTING_KEY_HEADER
from draftgen.job import load_job
from draftgen.local import find_free_port
from draftgen.running.attach import AttachedServers
from draftgen.running.monitor import RunMonitor
from draftgen.running.runner import RunOptions, run_job
from draftgen.running.stats import RunStats
from draftgen.schedule.adaptive import AdaptiveScheduler
from draftgen.schedule.pool import Route, ServerPool, ServerState
from draftgen.servers import QualityPolicyError
from helpers.fakeserver import completion

DATA = Path(__file__).parents[1] / "gateways" / "data"
RECORDED = (DATA / "smg-1.13.0-engine_metrics.txt").read_text()
OWN = (DATA / "vllm-0.32.0-metrics.txt").read_text()
WORKERS = json.loads((DATA / "smg-1.13.0-workers-busy.json").read_text())
A = "http://127.0.0.1:50905"  # the recorded worker
B = "http://10.0.0.2:8000"  # the same page relabelled: a second worker, 3 running


def two_workers() -> str:
    other = (RECORDED.replace(A, B).replace(f'worker_addr="{B}"}} 10\n',
                                              f'worker_addr="{B}"}} 3\n'))
    return RECORDED + other


class Gateway:
    """GET /engine_metrics and /workers, counted."""

    def __init__(self, page: str) -> None:
        self.page = page
        self.hits: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/engine_metrics", self._metrics)
        app.router.add_get("/workers", self._workers)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.hits.append("/engine_metrics")
        return web.Response(text=self.page)

    async def _workers(self, _request: web.Request) -> web.Response:
        self.hits.append("/workers")
        return web.json_response(WORKERS)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    g = Gateway(two_workers())
    await g.start()
    try:
        yield g
    finally:
        await g.stop()


async def test_one_read_of_the_gateway_serves_all_its_workers_each_its_own_load(
        gateway: Gateway) -> None:
    clock = FakeClock()
    logs: list[str] = []
    async with aiohttp.ClientSession() as session:
        loads = GatewayLoads(session, gateway.url, clock=clock)
        a, b = (RelayedPoller(loads, u, log=logs.append) for u in (A, B))
        got = await asyncio.gather(a.poll(), b.poll())
        assert gateway.hits == ["/engine_metrics"]
        la, lb = got
        assert la is not None and lb is not None
        assert (la.running, lb.running) == (10, 3)
        own = read_metrics(OWN)[0]
        assert la.kv_usage == own["kv_usage"] and la.kv_capacity_tokens == 4096
        assert la.source == f"vllm /metrics via {gateway.url}/engine_metrics"
        assert a.refused is False and a.failure is None
        assert f"{A}: load from {la.source}" in logs
        await a.poll()  # the same round: the read is reused
        assert gateway.hits == ["/engine_metrics"]
        clock.advance(FRESH_S)
        await a.poll()  # the next round reads again
        assert gateway.hits == ["/engine_metrics"] * 2


async def test_a_worker_the_page_lacks_or_a_silent_gateway_give_no_load_and_no_refusal(
        gateway: Gateway) -> None:
    clock = FakeClock()
    async with aiohttp.ClientSession() as session:
        loads = GatewayLoads(session, gateway.url, clock=clock)
        gone = RelayedPoller(loads, "http://10.0.0.3:8000")
        assert await gone.poll() is None
        assert gone.failure is not None and "has no series of" in gone.failure
        assert gone.refused is False
        await gateway.stop()
        clock.advance(FRESH_S)
        a = RelayedPoller(loads, A)
        assert await a.poll() is None
        assert a.failure is not None and a.failure.startswith(f"{gateway.url}/engine_metrics")
        assert a.refused is False


async def test_the_monitor_polls_relayed_workers_through_their_gateway(
        gateway: Gateway, tmp_path: Path) -> None:
    clock = FakeClock()
    route = Route(gateway.url, {}, relayed=True)
    gone = "http://10.0.0.3:8000"  # relayed, but the page has no series of it

    async def probe(_s: ServerState) -> None:
        return None

    pool = ServerPool([A, B, gone], routes={A: route, B: route, gone: route}, clock=clock,
                      probe=probe, hang_timeout_s=60, on_hang=lambda _s: None)
    pool.servers[2].in_flight = 2
    scheduler = AdaptiveScheduler()
    monitor = RunMonitor(tmp_path, pool=pool, scheduler=scheduler, stats=RunStats(clock),
                         clock=clock, interval_s=1.0, give_up_s=None, waiting=lambda: 0,
                         wake=lambda: None, give_up=lambda _r: None, log=lambda _m: None)
    async with monitor:
        await monitor.poll()
    assert gateway.hits == ["/engine_metrics"]  # one read for the three of them
    assert monitor.loads[A].running == 10 and monitor.loads[B].running == 3
    assert gone not in monitor.loads
    # Not abandoned for a port of its own: it leaves when the gateway's list says so.
    assert pool.servers[2].up and pool.servers[2].in_flight == 2
    view = {s.url: s for s in monitor._server_view()}
    assert view[gone].load_error is not None and view[A].running == 10


@pytest.mark.parametrize("cache_dtype, verified", [("bfloat16", True), ("fp8", None),
                                                   (None, False)])
async def test_a_relayed_worker_is_verified_from_what_the_gateway_relays(
        tmp_path: Path, cache_dtype: str | None, verified: bool | None) -> None:
    page = RECORDED
    if cache_dtype is None:
        page = "\n".join(ln for ln in page.splitlines() if "cache_config_info" not in ln)
    else:
        page = page.replace('cache_dtype="auto"', f'cache_dtype="{cache_dtype}"')
    gw = Gateway(page)
    await gw.start()
    try:
        servers = AttachedServers(load_job(make_job(tmp_path, rows(1))), [], tmp_path,
                                  log=lambda _m: None)
        servers.worker_of(gw.url, A, relayed=True)
        if verified is None:  # lossy: refused, as a server reached directly would be
            with pytest.raises(QualityPolicyError, match="lossy KV cache"):
                await servers.verify(A)
            return
        record = await servers.verify(A)
    finally:
        await gw.stop()
    assert record is not None and record["verified"] is verified
    assert set(gw.hits) == {"/engine_metrics", "/workers"}
    if verified:
        assert (record["engine"], record["version"], record["kv_dtype"], record["kv_tokens"],
                record["context_length"]) == ("vllm", "0.32.0", "bfloat16", 4096, 1024)
        assert servers.configuration_of(A) is not None
        assert servers.request_fields(A) == {"return_token_ids": True}
    else:  # unverifiable but allowed: used, recorded as unverified, with the reason
        assert "does not say what it runs with" in record["reason"]
        assert servers.configuration_of(A) is None


def closed_gateway_app(workers: list[str], hits: collections.Counter[str]) -> web.Application:
    """A manual-policy gateway in front of `workers`, whose own URLs lead nowhere: it lists
    them, relays their metrics (the recorded page, bf16 KV) and answers chats as theirs."""
    page = "".join(RECORDED.replace(A, w).replace('cache_dtype="auto"', 'cache_dtype="bfloat16"')
                   for w in workers)
    labels = WORKERS["workers"][0]["labels"]
    listed = {"workers": [{"url": w, "id": w, "is_healthy": True, "status": "ready",
                           "runtime_type": "vllm", "labels": labels} for w in workers]}
    pins: dict[str, str] = {}
    turn = itertools.count()

    async def get(request: web.Request) -> web.Response:
        hits[request.path] += 1
        if request.path == "/engine_metrics":
            return web.Response(text=page)
        if request.path == "/workers":
            return web.json_response(listed)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake"}]})
        return web.Response(status=404)

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        key = request.headers.get(ROUTING_KEY_HEADER, "")
        worker = pins.setdefault(key, workers[next(turn) % len(workers)])
        hits[worker] += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               ROUTED_WORKER_HEADER: worker})
        await response.prepare(request)
        for step in completion(["an", " answer"]).steps:
            assert isinstance(step, bytes)
            await response.write(step)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/{tail:.*}", get)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_run_through_a_gateway_whose_workers_only_it_reaches(tmp_path: Path) -> None:
    workers = [f"http://127.0.0.1:{find_free_port()}" for _ in range(2)]  # nothing listens
    hits: collections.Counter[str] = collections.Counter()
    runner = web.AppRunner(closed_gateway_app(workers, hits))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gateway = f"http://127.0.0.1:{runner.addresses[0][1]}"
    job = make_job(tmp_path, rows(12))
    job.write_text(job.read_text() + "poll_interval_s: 0.1\n")
    try:
        summary = await asyncio.wait_for(run_job(load_job(job), RunOptions(
            tmp_path / "out", gateways=[gateway], progress=False)), timeout=60)
    finally:
        await runner.cleanup()
    assert (summary.done, summary.failed, summary.pending) == (12, 0, 0)
    recs = [orjson.loads(x) for p in sorted((tmp_path / "out" / "shards").glob("*"))
            for x in p.read_bytes().splitlines()]
    assert {r["server"] for r in recs} <= set(workers)
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    run = manifest["runs"][-1]
    records = {r["url"]: r for r in run["servers"]}
    assert set(records) == set(workers)
    assert all(r["verified"] and r["kv_dtype"] == "bfloat16" for r in records.values())
    assert hits["/engine_metrics"] >= 2  # verification (one per worker) and load polls
    # The gateway's /v1/models does not say the context: its workers' labels did.
    assert manifest["context"]["tokens"] == 1024
    assert any("does not answer on its own URL" in e for e in run["events"])
    assert not any("refuses" in e or "leaves" in e for e in run["events"]), run["events"]
    assert sum(f"load from vllm /metrics via {gateway}/engine_metrics" in e
               for e in run["events"]) == 2

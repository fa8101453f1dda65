"""Measurements for the capacity model: from a run directory, and from a live server."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from draftgen.engines.sglang.info import parse_server_info
from draftgen.engines.vllm.info import parse_info
from draftgen.planning.calibrate import (
    calibrate,
    capacity_of,
    concurrency_levels_for,
    parse_metrics,
)
from draftgen.planning.measured import (
    Measured,
    decode_intervals,
    measure_from_run,
    speed_from_intervals,
)
from draftgen.planning.workload import DecodeSpeed
from draftgen.store.ledger import LedgerEntry
from draftgen.store.run_store import entry_for
from draftgen.store.shards import ShardWriter
from helpers.fakeserver import DONE, chunk, usage


def rec(i: int, *, server: str = "http://a", start: float, end: float, ttft: float,
        tokens: int, cat: str = "chat", finish: str = "stop") -> dict[str, Any]:
    return {"id": f"s{i}", "fingerprint": f"f{i}", "category": cat, "partition": "short",
            "messages": [], "followups": [], "server": server, "attempts": 1,
            "finished_at": end, "status": "done",
            "turns": [{"content": "x", "reasoning": None, "finish_reason": finish,
                       "prompt_tokens": 5, "completion_tokens": tokens, "ttft_s": ttft,
                       "duration_s": end - start}]}


def test_speed_from_overlapping_decodes_is_exact() -> None:
    # A decodes 100 tokens over [0, 10]; B 50 tokens over [5, 10]: one at 10 tok/s, then two.
    intervals = decode_intervals([rec(0, start=-1, end=10, ttft=1, tokens=100),
                                  rec(1, start=4, end=10, ttft=1, tokens=50)])
    assert intervals == {"http://a": [(0, 10, 100), (5, 10, 50)]}
    speed = speed_from_intervals(intervals)
    assert speed is not None
    assert speed.points == ((1.0, 10.0), (2.0, 20.0))


def test_servers_are_swept_separately_and_multi_turn_records_placed_back_to_back() -> None:
    r = rec(0, start=0, end=20, ttft=1, tokens=40)
    r["turns"] = [{**r["turns"][0], "duration_s": 10.0, "ttft_s": 2.0, "completion_tokens": 16},
                  {**r["turns"][0], "duration_s": 10.0, "ttft_s": 2.0, "completion_tokens": 8}]
    other = rec(1, server="http://b", start=0, end=20, ttft=0.0, tokens=40)
    got = decode_intervals([r, other])
    assert sorted(got["http://a"]) == [(2.0, 10.0, 16), (12.0, 20.0, 8)]
    speed = speed_from_intervals(got)
    assert speed is not None
    [(batch, tok_s)] = speed.points
    assert batch == 1.0
    assert tok_s == pytest.approx((16 + 8 + 40) / (8 + 8 + 20))


def test_untimed_or_one_token_turns_give_no_speed() -> None:
    r = rec(0, start=0, end=5, ttft=1, tokens=1)
    untimed = rec(1, start=0, end=5, ttft=1, tokens=50)
    untimed["turns"][0]["ttft_s"] = None
    assert decode_intervals([r, untimed]) == {}
    assert speed_from_intervals({}) is None


def make_run(out: Path) -> None:
    out.mkdir()
    plan = []
    records = []
    for i in range(40):
        cat = "chat" if i % 2 else "code"
        plan.append({"id": f"s{i}", "category": cat, "partition": "short",
                     "fingerprint": f"f{i}", "prompt_tokens": 10 + i, "max_tokens": 64})
        if i < 30:
            tokens = 64 if i % 10 == 0 else 20 + i
            records.append(rec(i, start=100 + i, end=110 + i, ttft=0.5, tokens=tokens, cat=cat,
                               finish="length" if tokens == 64 else "stop"))
    writer = ShardWriter(out)
    spots = writer.append([orjson.dumps(r) + b"\n" for r in records])
    writer.close()
    lines = [entry_for(r, spot).to_line() for r, spot in zip(records, spots, strict=True)]
    # A record of an older request: the plan's fingerprint differs, so it is not counted.
    lines.append(LedgerEntry("s35", "old", "done", "chat", "short", output_tokens=999).to_line())
    lines.append(LedgerEntry("s36", "f36", "failed", "chat", "short", reason="x").to_line())
    (out / "ledger.jsonl").write_bytes(b"".join(lines))
    (out / "plan.jsonl").write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in plan))
    (out / "timeseries.jsonl").write_bytes(
        orjson.dumps({"t": 1.0, "servers": {"http://a": {"capacity": 8192}}}) + b"\n"
        + orjson.dumps({"t": 2.0, "servers": {"http://a": {"capacity": None}}}) + b"\n{")


def test_measure_from_run_reads_lengths_truncation_speed_and_capacity(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    m = measure_from_run(tmp_path / "run")
    assert m.prompt_tokens[("code", "short")] == tuple(10 + i for i in range(0, 40, 2))
    assert len(m.output_tokens[("chat", "short")]) == 15
    assert len(m.output_tokens[("code", "short")]) == 15
    assert 999 not in m.output_tokens[("chat", "short")]
    assert m.truncated == {("code", "short"): 3, ("chat", "short"): 0}
    assert m.kv_tokens == 8192
    assert m.speed is not None
    assert max(b for b, _ in m.speed.points) > 5  # ten requests overlap in the middle
    server = m.server_capacity()
    assert server.kv_tokens == 8192
    assert m.server_capacity(kv_tokens=100, servers=3).servers == 3


def test_measured_without_capacity_needs_a_lever() -> None:
    with pytest.raises(ValueError, match="KV capacity unknown"):
        Measured().server_capacity()
    lengths = Measured(output_tokens={("a", "p"): (1, 2)}, source="run")
    server = Measured(speed=DecodeSpeed(((1, 5.0),)), kv_tokens=10, block_size=16,
                      source="calibration")
    both = lengths.with_server_from(server)
    assert both.output_tokens == {("a", "p"): (1, 2)}
    assert both.server_capacity().block_size == 16
    assert both.source == "run + calibration"


VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="64"} 1.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1796.0
"""


def test_metrics_parsing_and_vllm_capacity() -> None:
    values = parse_metrics(VLLM_METRICS)
    assert values["vllm:generation_tokens_total"] == 1796
    cap = capacity_of(parse_info("http://a", VLLM_METRICS))
    assert (cap.kv_tokens, cap.block_size, cap.max_running) == (8192, 128, None)
    newer = VLLM_METRICS.replace('engine="0",num', 'engine="0",kv_cache_size_tokens="9000",num')
    assert capacity_of(parse_info("http://a", newer)).kv_tokens == 9000
    assert capacity_of(None).kv_tokens is None


class FakeEngine:
    """A batch engine in miniature: admits up to `max_running` streams first come first
    served, and each step gives every admitted stream one token, counting steps and
    tokens in vLLM's metric names."""

    def __init__(self, max_running: int, step_s: float = 0.002) -> None:
        self.max_running = max_running
        self.step_s = step_s
        self.waiting: deque[asyncio.Queue[None]] = deque()
        self.running: list[asyncio.Queue[None]] = []
        self.gen = 0
        self.steps = 0
        self.url = ""

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            while self.waiting and len(self.running) < self.max_running:
                self.running.append(self.waiting.popleft())
            if self.running:
                self.steps += 1
                self.gen += len(self.running)
                for q in self.running:
                    q.put_nowait(None)

    async def _metrics(self, _: web.Request) -> web.Response:
        text = VLLM_METRICS.replace("1796.0", str(self.gen)) + (
            f"vllm:iteration_tokens_total_count {self.steps}\n"
            f"vllm:num_requests_running {len(self.running)}\n"
            f"vllm:num_requests_waiting {len(self.waiting)}\n")
        return web.Response(text=text)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = len(body["messages"][0]["content"].split())
        await asyncio.sleep(prompt / 50_000)  # prefill
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        q: asyncio.Queue[None] = asyncio.Queue()
        self.waiting.append(q)
        try:
            for _ in range(body["max_tokens"]):
                await q.get()
                await resp.write(chunk("w"))
            await resp.write(chunk(finish="length") + usage(prompt, body["max_tokens"]) + DONE)
        finally:
            if q in self.running:
                self.running.remove(q)
            elif q in self.waiting:
                self.waiting.remove(q)
        return resp


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    eng = FakeEngine(max_running=2)
    app = web.Application()
    app.router.add_get("/metrics", eng._metrics)
    app.router.add_post("/v1/chat/completions", eng._chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    eng.url = f"http://127.0.0.1:{port}"
    loop_task = asyncio.create_task(eng._loop())
    yield eng
    loop_task.cancel()
    await runner.cleanup()


async def test_calibrate_reads_the_engine_batch_and_capacity(engine: FakeEngine) -> None:
    m = await calibrate(engine.url, "m", concurrency_levels=(1, 4), max_tokens=16,
                        seconds=0.6, warmup_s=0.2, prefill=True)
    assert m.kv_tokens == 8192
    assert m.block_size == 128
    assert m.speed is not None
    batches = [b for b, _ in m.speed.points]
    # One stream decodes alone; four are held to the engine's two running.
    assert batches[0] == pytest.approx(1.0, abs=0.15)
    assert batches[-1] == pytest.approx(2.0, abs=0.3)
    assert m.speed.prefill_tok_s is not None and m.speed.prefill_tok_s > 0
    assert m.speed.source == "calibrated"
    assert engine.running == [] and not engine.waiting  # every stream was stopped


def test_sglang_server_info_gives_capacity_page_and_running_limit() -> None:
    info = parse_server_info("http://a", {"max_total_num_tokens": 376_000, "page_size": 1,
                                          "dp_size": 2, "max_running_requests": 512})
    cap = capacity_of(info)
    assert (cap.kv_tokens, cap.block_size, cap.max_running) == (752_000, 1, 512)
    assert "dp 2" in cap.note
    assert capacity_of(parse_server_info("http://a", {"tp_size": 8})).kv_tokens is None


def test_concurrency_levels_reach_the_jobs_concurrency() -> None:
    assert concurrency_levels_for(1) == (1,)
    assert concurrency_levels_for(4) == (1, 4)
    assert concurrency_levels_for(182) == (1, 4, 16, 64, 182)

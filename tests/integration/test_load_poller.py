"""LoadPoller against the real vLLM CPU engine with a KV cache small enough to saturate."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from draftgen.clock import REAL_CLOCK
from draftgen.engine import LocalEngine
from draftgen.schedule.load import FIELDS, LoadPoller, ServerLoad

BLOCKS = 16
REQUESTS = 24
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def small_engine(
    engine_installed: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalEngine]:
    log_path = tmp_path_factory.mktemp("load-engine") / "vllm.log"
    engine = LocalEngine(tiny_model_dir, num_gpu_blocks_override=BLOCKS, max_model_len=1024,
                         log_path=log_path)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def logged_kv_tokens(engine: LocalEngine) -> int:
    """The KV capacity the engine states in its own log at start."""
    assert engine.log_path is not None
    found = re.search(r"KV cache size: ([\d,]+) tokens", engine.log_path.read_text())
    assert found, "vLLM no longer logs its KV cache size"
    return int(found.group(1).replace(",", ""))


async def poll(session: aiohttp.ClientSession, url: str) -> ServerLoad:
    load = await LoadPoller(session, url, clock=REAL_CLOCK).poll()
    assert load is not None
    return load


async def test_capacity_matches_the_engine_and_an_idle_engine_reads_zero(
    small_engine: LocalEngine,
) -> None:
    logs: list[str] = []
    async with aiohttp.ClientSession() as session:
        load = await LoadPoller(session, small_engine.url, clock=REAL_CLOCK,
                                log=logs.append).poll()
    assert load is not None
    assert load.source == "vllm /metrics"
    assert load.missing == ()
    assert load.kv_capacity_tokens == logged_kv_tokens(small_engine) == 2048
    assert (load.running, load.waiting, load.kv_used_tokens, load.kv_usage) == (0, 0, 0, 0.0)
    assert logs == [f"{small_engine.url}: load from vllm /metrics"]


async def test_under_load_the_poller_sees_running_queueing_or_preemption(
    small_engine: LocalEngine,
) -> None:
    async with aiohttp.ClientSession() as session:
        before = await poll(session, small_engine.url)
        poller = LoadPoller(session, small_engine.url, clock=REAL_CLOCK)
        seen: list[ServerLoad] = []

        async def one(i: int) -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"story {i}"}],
                    "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            async with session.post(f"{small_engine.url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                async for _ in r.content:
                    pass

        async def watch(done: asyncio.Event) -> None:
            while not done.is_set():
                load = await poller.poll()
                assert load is not None
                seen.append(load)
                await asyncio.sleep(0.2)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        finally:
            done.set()
            await watcher
        after = await poll(session, small_engine.url)

    assert seen, "no poll finished while the requests ran"
    assert all(s.missing == () for s in seen)
    assert max(s.running or 0 for s in seen) > 0
    # 24 requests of up to ~210 tokens each do not fit in 2,048 KV tokens at once.
    assert (max(s.waiting or 0 for s in seen) > 0
            or (after.preemptions_total or 0) > (before.preemptions_total or 0))
    assert max(s.kv_usage or 0.0 for s in seen) > 0.5
    assert all(0 <= (s.kv_used_tokens or 0) <= 2048 for s in seen)
    # Counters: every requested token was generated once, in more engine steps than one.
    assert before.generation_tokens_total is not None
    assert after.generation_tokens_total == before.generation_tokens_total + REQUESTS * MAX_TOKENS
    assert (after.engine_steps_total or 0) > (before.engine_steps_total or 0) + MAX_TOKENS
    assert (after.running, after.waiting) == (0, 0)
    assert set(FIELDS) == {f for f in FIELDS if getattr(after, f) is not None}

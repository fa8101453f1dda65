"""The capacity model's inputs measured on the real engine, and the metrics endpoint
scraped while a real run goes on. Accuracy itself is `bench/capacity_accuracy.py`'s job:
wall-clock speed is never asserted here."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

from draftgen.job import load_job
from draftgen.local import LocalEngine
from draftgen.planning.calibrate import calibrate
from draftgen.planning.capacity import predict
from draftgen.planning.measured import measure_from_run
from draftgen.planning.plan import build_plan
from draftgen.planning.workload import Workload
from draftgen.running.metrics import MetricsExporter
from draftgen.running.runner import Runner, RunOptions


def write_job(tmp: Path, n: int) -> Path:
    with open(tmp / "p.jsonl", "wb") as f:
        for i in range(n):
            msg = {"role": "user", "content": f"Tell me a story about the number {i}."}
            f.write(orjson.dumps({"messages": [msg]}) + b"\n")
    job = tmp / "job.yaml"
    job.write_text("""
model: tiny
sampling: {temperature: 0.7, extra_body: {logit_bias: {"2": 4.0}}}
partitions:
  short: {max_tokens: 64, concurrency: 16}
categories:
  - {name: chat, source: {path: p.jsonl}, partition: short}
output: out
""")
    return job


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name + orjson.dumps(s.labels, option=orjson.OPT_SORT_KEYS).decode(): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_calibrate_a_run_and_predict_it(local_engine: LocalEngine, tmp_path: Path) -> None:
    cal = await calibrate(local_engine.url, "tiny", concurrency_levels=(1, 4),
                          max_tokens=32, seconds=1.0, warmup_s=0.5)
    # The fixture's engine: 1 GiB of KV at 1 KiB a token, in pages of 128 tokens.
    assert cal.kv_tokens == 1 << 20
    assert cal.block_size == 128
    assert cal.speed is not None
    batches = [b for b, _ in cal.speed.points]
    assert len(batches) == 2
    assert batches[0] < batches[1] <= 4.5  # read from the engine's own step counter
    assert cal.speed.prefill_tok_s is not None and cal.speed.prefill_tok_s > 0

    job = load_job(write_job(tmp_path, 40))
    exporter = MetricsExporter()
    port = exporter.start(0)
    runner = Runner(job, RunOptions(out_dir=tmp_path / "out", servers=[local_engine.url],
                                    progress=False))
    seen: list[dict[str, float]] = []

    async def publish() -> None:
        while True:
            exporter.update(runner.stats.snapshot())
            seen.append(await asyncio.to_thread(scrape, port))
            await asyncio.sleep(0.2)

    feeder = asyncio.create_task(publish())
    try:
        summary = await runner.run()
        exporter.update(runner.stats.snapshot())
        final = await asyncio.to_thread(scrape, port)
    finally:
        feeder.cancel()
        exporter.stop()
    assert summary.done == 40
    assert final['draftgen_requests_total{"status":"done"}'] == 40
    assert final['draftgen_samples{"category":"chat","state":"pending"}'] == 0
    assert final["draftgen_output_tokens_total{}"] > 40
    assert final["draftgen_in_flight{}"] == 0
    assert any(s.get("draftgen_in_flight{}", 0) > 0 for s in seen)  # scraped mid-run

    run = measure_from_run(tmp_path / "out")
    outs = run.output_tokens[("chat", "short")]
    assert len(outs) == 40
    assert sum(outs) == final["draftgen_output_tokens_total{}"]
    assert run.speed is not None

    measured = run.with_server_from(cal)
    pred = predict(measured.server_capacity(),
                   Workload.from_samples(build_plan(job).samples, {"short": 16},
                                         run.output_tokens))
    assert pred.samples == 40
    assert pred.steady.bound == "concurrency"  # a million tokens of cache: 16 at a time
    assert 0 < pred.mean_running <= 16
    assert pred.duration_s > 0

"""The Prometheus endpoint of a real run, scraped while it runs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from test_reliability import job_file

from draftgen.job import load_job
from draftgen.local import LocalEngine
from draftgen.running.runner import Runner, RunOptions


async def test_metrics_are_served_during_a_run(local_engine: LocalEngine, tmp_path: Path) -> None:
    job = job_file(tmp_path, local_engine.url, n=120, max_tokens=64, conc=8)
    runner = Runner(load_job(job), RunOptions(tmp_path / "out", progress=False, metrics_port=0))
    run = asyncio.create_task(runner.run())
    events = tmp_path / "out" / "events.jsonl"
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    async with asyncio.timeout(240), aiohttp.ClientSession() as http:
        while not (events.exists() and b"metrics on" in events.read_bytes()):
            await asyncio.sleep(0.1)
        port = re.search(rb"127\.0\.0\.1:(\d+)/metrics", events.read_bytes())
        assert port is not None
        url = f"http://127.0.0.1:{int(port.group(1))}/metrics"
        while not families.get("draftgen_server_kv_capacity_tokens"):
            async with http.get(url) as r:
                text = await r.text()
            families = {f.name: [(s.labels, s.value) for s in f.samples]
                        for f in text_string_to_metric_families(text)}
            await asyncio.sleep(0.2)
    summary = await run
    assert summary.done == 120
    [(labels, capacity)] = families["draftgen_server_kv_capacity_tokens"]
    assert labels == {"server": local_engine.url} and capacity == 1_048_576
    planned = {lab["category"]: v for lab, v in families["draftgen_samples"]
               if lab["state"] == "planned"}
    assert planned == {"q": 120}
    assert "draftgen_in_flight" in families and "draftgen_output_tokens_per_second" in families

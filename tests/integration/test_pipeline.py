"""plan → run → status → export through the CLI, against the real local engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from draftgen.local import LocalEngine

PY = [sys.executable, "-m", "draftgen"]


def write_job(tmp: Path, url: str, *, n: int, max_tokens: int = 24, conc: int = 8) -> Path:
    topics = ["rivers", "prime numbers", "sorting", "bread", "volcanoes", "chess", "tides"]
    with open(tmp / "chat.jsonl", "wb") as f:
        for i in range(n // 2):
            msg = {"role": "user", "content": f"Tell me about {topics[i % 7]} ({i})."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    with open(tmp / "code.jsonl", "wb") as f:
        for i in range(n - n // 2):
            f.write(orjson.dumps({"prompt": f"Write a function number {i}."}) + b"\n")
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{url}]
sampling: {{temperature: 0, seed: 11, extra_body: {{ignore_eos: true}}}}
partitions:
  short: {{max_tokens: {max_tokens}, concurrency: {conc}}}
  long: {{max_tokens: {max_tokens * 2}, concurrency: {max(1, conc // 4)}}}
categories:
  - {{name: chat, source: {{path: chat.jsonl, id_field: id}}, partition: short,
     system_prompt: "You are terse."}}
  - {{name: code, source: {{path: code.jsonl, layout: prompt}}, partition: long}}
output: out
progress_interval_s: 1
""")
    return job


def draftgen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PY, *args], capture_output=True, text=True, timeout=600)


def requests_served(engine: LocalEngine) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def shard_records(out: Path) -> list[dict[str, Any]]:
    recs = []
    for p in sorted((out / "shards").glob("*.jsonl")):
        recs += [orjson.loads(line) for line in p.read_bytes().splitlines()]
    return recs


def test_full_run_export_and_a_second_run_that_sends_nothing(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    job = write_job(tmp_path, local_engine.url, n=30)
    out = tmp_path / "out"

    planned = draftgen("plan", str(job), "--json")
    assert planned.returncode == 0, planned.stderr
    rows = orjson.loads(planned.stdout)["rows"]
    assert sum(r["samples"] for r in rows) == 30

    ran = draftgen("run", str(job))
    assert ran.returncode == 0, ran.stderr
    assert "30/30 done, 0 failed" in ran.stdout
    # Not a terminal: plain progress lines went to stderr.
    assert "tok/s" in ran.stderr

    st = orjson.loads(draftgen("status", str(out), "--json").stdout)
    assert (st["total"], st["done"], st["failed"], st["pending"]) == (30, 30, 0, 0)
    # ignore_eos: every sample is exactly max_tokens long (24 short, 48 long).
    assert st["output_tokens"] == 15 * 24 + 15 * 48
    assert st["truncated"] == 30  # finish_reason "length" at max_tokens
    assert st["categories"]["chat"]["done"] == 15

    served = requests_served(local_engine)
    again = draftgen("run", str(job))
    assert again.returncode == 0 and "sent 0 this run" in again.stdout
    assert requests_served(local_engine) == served

    to = tmp_path / "sf.jsonl"
    exp = draftgen("export", str(out), "--to", str(to), "--include-truncated")
    assert exp.returncode == 0, exp.stderr
    lines = [orjson.loads(x) for x in to.read_bytes().splitlines()]
    assert len(lines) == 30 and len({r["id"] for r in lines}) == 30
    for r in lines:
        roles = [m["role"] for m in r["conversations"]]
        assert roles in (["system", "user", "assistant"], ["user", "assistant"])
        assert all(isinstance(m["content"], str) and m["content"] for m in r["conversations"])
    chat = next(r for r in lines if r["id"].startswith("chat-"))
    assert chat["conversations"][0] == {"role": "system", "content": "You are terse."}
    # Truncated samples are left out unless asked for.
    default = draftgen("export", str(out), "--to", str(tmp_path / "d.jsonl"))
    assert "exported 0 samples" in default.stdout and "30 truncated" in default.stdout


def test_sigkill_mid_run_then_rerun_gives_each_planned_id_once(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    job = write_job(tmp_path, local_engine.url, n=200, max_tokens=48, conc=16)
    out = tmp_path / "out"
    ledger = out / "ledger.jsonl"
    kills = 0
    for threshold in (20, 70, 120):
        proc = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if ledger.exists() and ledger.read_bytes().count(b"\n") >= threshold:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.02)
        proc.wait(timeout=60)
    assert kills == 3

    final = draftgen("run", str(job))
    assert final.returncode == 0, final.stderr
    assert "200/200 done, 0 failed" in final.stdout

    plan_ids = {orjson.loads(x)["id"] for x in (out / "plan.jsonl").read_bytes().splitlines()}
    records = shard_records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "a sample was stored twice"
    assert set(ids) == plan_ids and len(plan_ids) == 200
    for r in records:
        assert r["turns"][0]["completion_tokens"] in (48, 96)
    ledger_ids = [orjson.loads(x)["id"] for x in ledger.read_bytes().splitlines()]
    assert sorted(set(ledger_ids)) == sorted(plan_ids)
    assert len(ledger_ids) == 200, "a ledger line was written twice"

"""Two real engines with different KV sizes behind one job: the adaptive scheduler gives the
larger one more of the work, and when one is killed mid-run its work moves to the other with
nothing lost and nothing stored twice."""

from __future__ import annotations

import collections
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families
from test_pipeline import PY, shard_records
from test_reliability import assert_each_planned_id_once, wait_for

from draftgen.engine import LocalEngine

N = 160


def finished_by(*engines: LocalEngine) -> int:
    """Requests the engines report finished (their own `vllm:request_success_total`)."""
    total = 0.0
    for engine in engines:
        with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                total += sum(s.value for s in family.samples
                             if s.name == "vllm:request_success_total")
    return int(total)


def test_share_follows_capacity_and_a_killed_server_loses_nothing(
    engine_installed: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # One core each: two busy engines pinned to the same core starve each other.
    small = LocalEngine(tiny_model_dir, num_gpu_blocks_override=16, max_model_len=1024,
                        log_path=tmp_path / "small.log",
                        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    big = LocalEngine(tiny_model_dir, num_gpu_blocks_override=64, max_model_len=1024,
                      log_path=tmp_path / "big.log",
                      extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    starter = threading.Thread(target=small.start)
    starter.start()
    try:
        big.start()
    finally:
        starter.join()
    with open(tmp_path / "p.jsonl", "wb") as f:
        for i in range(N):
            msg = {"role": "user", "content": f"Question {i}: tell me about {i}."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    # Unseeded: vLLM-CPU kills its engine when a seeded request is preempted.
    job = tmp_path / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{small.url}, {big.url}]
scheduler: adaptive
sampling: {{temperature: 0, extra_body: {{ignore_eos: true}}}}
partitions: {{p: {{max_tokens: 160, concurrency: 150}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
client: {{retry: {{max_attempts: 8, backoff_base_s: 0.05, backoff_max_s: 0.5}}}}
output: out
progress_interval_s: 1
poll_interval_s: 0.5
""")
    out = tmp_path / "out"
    run = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        # Counted by the engines, not from our ledger: the ledger is committed in groups,
        # and on a busy machine one group can hold the rest of the run, leaving nothing
        # to finish after the kill.
        wait_for(lambda: finished_by(small, big) >= N // 3)
        killed_at = time.time()
        small.kill()
        stdout, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
        small.stop()
        big.stop()
    assert run.returncode == 0, stderr
    assert f"{N}/{N} done, 0 failed" in stdout
    assert_each_planned_id_once(out, N)
    recs = shard_records(out)
    before = collections.Counter(r["server"] for r in recs if r["finished_at"] < killed_at)
    after = collections.Counter(r["server"] for r in recs if r["finished_at"] > killed_at + 1)
    print(f"MULTISERVER before kill {dict(before)}, after {dict(after)}")
    # 2,048 vs 8,192 KV tokens: the big engine holds more of the work at once.
    assert before[big.url] > before[small.url] > 0
    assert set(after) == {big.url}
    events = orjson.loads((out / "manifest.json").read_bytes())["runs"][-1]["events"]
    assert any(small.url in e and "down" in e for e in events)

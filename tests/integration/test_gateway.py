"""A run through the real SGLang Model Gateway (`smg`, pinned in the test set-up) over real
vLLM CPU engines: workers found at the gateway, one killed and one added mid-run, nothing
lost, nothing stored twice, every record naming the worker that generated it.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from test_pipeline import PY, shard_records
from test_reliability import assert_each_planned_id_once

from draftgen.engine import LocalEngine
from draftgen.servers.gateway import gateway_command, parse_workers
from draftgen.servers.process import find_free_port

N = 150


class Gateway:
    """An `smg` process on a free port, in front of `workers`."""

    def __init__(self, workers: list[str], log: Path) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._workers = workers
        self._log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = gateway_command(sys.executable, host="127.0.0.1", port=self.port,
                               metrics_port=find_free_port(), worker_urls=self._workers,
                               backend="vllm")
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if sum(w.ready for w in self.workers()) == len(self._workers):
                    return
            except OSError:
                pass
            assert self.proc.poll() is None, self._log.read_text()[-2000:]
            time.sleep(0.5)
        raise AssertionError(f"gateway not ready: {self._log.read_text()[-2000:]}")

    def workers(self) -> list:  # type: ignore[type-arg]
        with urllib.request.urlopen(self.url + "/workers", timeout=5) as r:
            return parse_workers(json.load(r), self.url)

    def add(self, url: str) -> None:
        req = urllib.request.Request(self.url + "/workers",
                                     data=json.dumps({"url": url}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status in (200, 202), r.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def engine(model: Path, log: Path, core: int, blocks: int = 32) -> LocalEngine:
    return LocalEngine(model, num_gpu_blocks_override=blocks, max_model_len=1024, log_path=log,
                       extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(core)})


def finished(e: LocalEngine) -> int:
    with urllib.request.urlopen(f"{e.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture
def two_workers(engine_installed: None, tiny_model_dir: Path,
                tmp_path: Path) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    a = engine(tiny_model_dir, tmp_path / "a.log", core=0)
    b = engine(tiny_model_dir, tmp_path / "b.log", core=1)
    t = threading.Thread(target=a.start)
    t.start()
    try:
        b.start()
    finally:
        t.join()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def write_job(tmp_path: Path, servers: str) -> Path:
    with open(tmp_path / "p.jsonl", "wb") as f:
        for i in range(N):
            msg = {"role": "user", "content": f"Question {i}: tell me about {i}."}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
    job = tmp_path / "job.yaml"
    # Unseeded: vLLM-CPU kills its engine when a seeded request is preempted.
    job.write_text(f"""
model: tiny
servers: {servers}
scheduler: adaptive
sampling: {{temperature: 0, extra_body: {{ignore_eos: true}}}}
partitions: {{p: {{max_tokens: 96, concurrency: 64}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
client: {{retry: {{max_attempts: 8, backoff_base_s: 0.05, backoff_max_s: 0.5}}}}
output: out
progress_interval_s: 1
poll_interval_s: 0.5
""")
    return job


def test_a_run_through_the_gateway_survives_a_worker_killed_and_one_added(
    two_workers: tuple[LocalEngine, LocalEngine], tiny_model_dir: Path, tmp_path: Path
) -> None:
    a, b = two_workers
    gw = Gateway([a.url, b.url], tmp_path / "gateway.log")
    gw.start()
    # Started now, added at the gateway only after the kill (on the killed one's core).
    c = engine(tiny_model_dir, tmp_path / "c.log", core=0)
    c.start()
    job = write_job(tmp_path, f"[{{gateway: {gw.url}}}]")
    out = tmp_path / "out"
    run = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        # The kill after a number of finished samples, never after a time (as in
        # test_multiserver): both workers have finished some by then.
        deadline = time.monotonic() + 300
        while not (finished(a) + finished(b) >= N // 4 and finished(a) and finished(b)):
            assert run.poll() is None, f"the run ended before the kill: {run.stderr.read()}"
            assert time.monotonic() < deadline, "timed out waiting for the kill"
            time.sleep(0.2)
        killed_at = time.time()
        a.kill()
        gw.add(c.url)
        added_at = time.time()
        stdout, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
        c.stop()
        gw.stop()
    assert run.returncode == 0, stderr
    assert f"{N}/{N} done, 0 failed" in stdout, stdout + stderr
    assert_each_planned_id_once(out, N)
    recs = shard_records(out)
    by_worker = collections.Counter(r["server"] for r in recs)
    after_kill = collections.Counter(r["server"] for r in recs if r["finished_at"] > killed_at + 2)
    print(f"GATEWAY records per worker {dict(by_worker)}; after the kill {dict(after_kill)}; "
          f"worker added {added_at - killed_at:.0f}s after the kill")
    # Every record names a worker (never the gateway) and the gateway it went through.
    assert set(by_worker) <= {a.url, b.url, c.url}
    assert all(r["gateway"] == gw.url for r in recs)
    assert by_worker[a.url] > 0 and by_worker[b.url] > 0
    assert a.url not in after_kill
    assert by_worker[c.url] > 0, "the worker added mid-run got no work"
    # Each record's configuration is its worker's, verified when it was found.
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert all(r["server_config"] in manifest["configurations"] for r in recs)
    # The added worker joined within seconds of being added at the gateway.
    joined = [orjson.loads(line) for line in (out / "events.jsonl").read_bytes().splitlines()]
    joined_at = next(e["t"] for e in joined if c.url in e["msg"] and "joins" in e["msg"])
    assert joined_at - added_at < 10
    # status counts samples per worker.
    status = subprocess.run([*PY, "status", str(out), "--json"], capture_output=True,
                            text=True, check=True)
    per_worker = json.loads(status.stdout).get("servers")
    assert per_worker == dict(by_worker), status.stdout

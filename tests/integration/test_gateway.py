"""A run through the real SGLang Model Gateway (`smg`, pinned in the test set-up) over real
vLLM CPU engines: workers found at the gateway, killed and one added mid-run, nothing lost,
nothing stored twice, every record naming the worker that generated it.
"""

from __future__ import annotations

import asyncio
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
from test_reliability import assert_each_planned_id_once, ledger_lines, wait_for

from draftgen.gateways.smg.api import gateway_command, parse_workers
from draftgen.local import LocalEngine
from draftgen.servers.process import find_free_port
from draftgen.testing.faultproxy import FaultProxy
from draftgen.testing.faults import FaultMix

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

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)


class Proxies:
    """Fault proxies in front of engines, served from a thread of their own."""

    def __init__(self, proxies: list[FaultProxy]) -> None:
        self.proxies = proxies
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Proxies:
        self._thread.start()
        for p in self.proxies:
            asyncio.run_coroutine_threadsafe(p.start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.proxies:
            asyncio.run_coroutine_threadsafe(p.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()  # (a loop left to the collector warns in a later test)


def engine(model: Path, log: Path, core: int, blocks: int = 32) -> LocalEngine:
    return LocalEngine(model, num_gpu_blocks_override=blocks, max_model_len=1024, log_path=log,
                       extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(core)})


def finished(e: LocalEngine) -> int:
    with urllib.request.urlopen(f"{e.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def two_workers(engine_installed: None, tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    """Shared by this module's tests (an engine start is most of a test's time); the test
    that kills one runs last."""
    logs = tmp_path_factory.mktemp("workers")
    a = engine(tiny_model_dir, logs / "a.log", core=0)
    b = engine(tiny_model_dir, logs / "b.log", core=1)
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


def test_a_gateway_restart_its_retries_and_a_refused_worker_lose_and_duplicate_nothing(
    two_workers: tuple[LocalEngine, LocalEngine], tmp_path: Path
) -> None:
    a, b = two_workers
    # Two more workers at the gateway, each a proxy in front of a real engine: one that says
    # its KV cache is fp8 (the quality policy refuses it, on any CPU), and one that answers
    # 40% of requests with a 503 before any byte, which the gateway retries elsewhere.
    lying = FaultProxy(a.url, mix=FaultMix(rate=0.0), rewrites={
        "/metrics": (b'cache_dtype="auto"', b'cache_dtype="fp8_e4m3"')})
    flaky = FaultProxy(b.url, mix=FaultMix(rate=0.4, weights={"status_503": 1.0}), seed=5)
    with Proxies([lying, flaky]):
        lying_url, flaky_url = lying.url, flaky.url
        gw = Gateway([a.url, b.url, lying_url, flaky_url], tmp_path / "gateway.log")
        gw.start()
        job = write_job(tmp_path, f"[{{gateway: {gw.url}}}]")
        out = tmp_path / "out"
        run = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: ledger_lines(out) >= N // 3)
            gw.kill()  # the gateway dies mid-run and comes back on its port
            time.sleep(3)
            gw.start()
            restarted_at = time.time()
            stdout, stderr = run.communicate(timeout=600)
        finally:
            run.kill()
            gw.stop()
        retried = flaky.counts["status_503"]
    assert run.returncode == 0, stderr
    assert f"{N}/{N} done, 0 failed" in stdout, stdout + stderr
    assert_each_planned_id_once(out, N)
    recs = shard_records(out)
    by_worker = collections.Counter(r["server"] for r in recs)
    after = collections.Counter(r["server"] for r in recs if r["finished_at"] > restarted_at)
    print(f"GATEWAY restart/retry: records per worker {dict(by_worker)}, after the restart "
          f"{dict(after)}; 503s the gateway retried {retried}; flaky proxy {dict(flaky.counts)}")
    assert retried > 0  # the gateway did retry, and no sample was stored twice for it
    assert lying_url not in by_worker  # the refused worker's answers are never kept
    assert set(by_worker) <= {a.url, b.url, flaky_url}
    assert sum(after.values()) > 0  # the run went on after the restart
    events = [orjson.loads(line)["msg"]
              for line in (out / "events.jsonl").read_bytes().splitlines()]
    assert any(lying_url in e and "refused by the quality policy" in e for e in events)


def test_a_run_through_the_gateway_survives_its_workers_killed_and_one_added(
    two_workers: tuple[LocalEngine, LocalEngine], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Both workers killed mid-run, one after the other, and a third added at the gateway
    between the kills: the run waits for it and finishes on it. (With a survivor, the run
    could end before the added worker joins — a few seconds of discovery, verification and
    key learning — on any machine fast enough: the added one then got nothing.)"""
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
        # (The engines' counters include what earlier tests of this module sent.)
        deadline = time.monotonic() + 300
        base = {e.url: finished(e) for e in (a, b)}

        def since(e: LocalEngine) -> int:
            return finished(e) - base[e.url]

        while not (since(a) + since(b) >= N // 4 and since(a) > 2 and since(b) > 2):
            assert run.poll() is None, f"the run ended before the kill: {run.stderr.read()}"
            assert time.monotonic() < deadline, "timed out waiting for the kill"
            time.sleep(0.2)
        killed_at = time.time()
        a.kill()
        gw.add(c.url)
        added_at = time.time()
        b.kill()
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
    assert set(after_kill) == {c.url}, "only the added worker can have finished these"
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


def test_the_example_job_launches_two_workers_and_a_gateway_and_stops_them(
    engine_installed: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """examples/demo/job-gateway.yaml: two pinned CPU workers and a gateway in front, started
    for the run and stopped after it, like one launched server."""
    job = Path(__file__).resolve().parents[2] / "examples" / "demo" / "job-gateway.yaml"
    out = tmp_path / "out"
    done = subprocess.run([*PY, "run", str(job), "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "96/96 done, 0 failed" in done.stdout, done.stdout + done.stderr[-3000:]
    recs = shard_records(out)
    workers = collections.Counter(r["server"] for r in recs)
    gateways = {r["gateway"] for r in recs}
    print(f"GATEWAY launched: records per worker {dict(workers)} through {gateways}")
    assert len(workers) == 2 and min(workers.values()) > 0 and len(gateways) == 1
    # Nothing left running: the workers' and the gateway's ports are closed.
    for url in [*workers, *gateways]:
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)

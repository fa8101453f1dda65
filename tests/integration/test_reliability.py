"""Nothing lost, nothing duplicated: faults, engine restarts, hangs, kills, signals, full
disks and bad input, all against the real local engine.

Each test prints one `RELIABILITY` line with what it injected and what came out;
docs/reliability.md quotes them.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from test_pipeline import PY, draftgen, shard_records

from draftgen.job import load_job
from draftgen.local import LocalEngine
from draftgen.running.runner import RunOptions, run_job
from draftgen.testing.faultproxy import FaultProxy
from draftgen.testing.faults import FaultMix


def job_file(tmp: Path, url: str, *, n: int, max_tokens: int, conc: int,
             client: str = "", extra: str = "", rows: list[dict[str, object]] | None = None
             ) -> Path:
    with open(tmp / "p.jsonl", "wb") as f:
        for i in range(n):
            msg = {"role": "user", "content": f"Question {i}: what comes after {i}?"}
            f.write(orjson.dumps({"id": i, "messages": [msg]}) + b"\n")
        for r in rows or []:
            f.write((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n")
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{url}]
sampling: {{temperature: 0, seed: 5, extra_body: {{ignore_eos: true}}}}
partitions: {{p: {{max_tokens: {max_tokens}, concurrency: {conc}}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
client: {{{client}retry: {{max_attempts: 8, backoff_base_s: 0.05, backoff_max_s: 0.5}}}}
output: out
progress_interval_s: 1
{extra}""")
    return job


def contents(out: Path) -> dict[str, str]:
    return {r["id"]: r["turns"][0]["content"] for r in shard_records(out)}


def assert_each_planned_id_once(out: Path, n: int) -> None:
    plan_ids = {orjson.loads(x)["id"] for x in (out / "plan.jsonl").read_bytes().splitlines()}
    ids = [r["id"] for r in shard_records(out)]
    assert len(ids) == len(set(ids)), "a sample was stored twice"
    assert set(ids) == plan_ids and len(plan_ids) == n


def ledger_lines(out: Path) -> int:
    try:
        return (out / "ledger.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for(cond: object, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


async def test_ten_percent_faults_give_the_same_results_as_a_clean_run(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    # Concurrency 1: vLLM's CPU kernels are not batch-invariant (at temperature 0, 4 of 60
    # answers differed between concurrency 8 and 1), and a retry changes who shares a batch.
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    for d in (clean_dir, faulty_dir):
        d.mkdir()
    clean = job_file(clean_dir, local_engine.url, n=80, max_tokens=16, conc=1)
    await run_job(load_job(clean), RunOptions(clean_dir / "out", progress=False))
    mix = FaultMix(rate=0.10, stall_s=20.0)
    async with FaultProxy(local_engine.url, mix=mix, seed=3) as proxy:
        faulty = job_file(faulty_dir, proxy.url, n=80, max_tokens=16, conc=1,
                          client="idle_timeout_s: 2, ")
        summary = await run_job(load_job(faulty), RunOptions(faulty_dir / "out", progress=False))
        counts = dict(proxy.counts)
    injected = sum(v for k, v in counts.items() if k not in ("forwarded", "passthrough"))
    print(f"RELIABILITY faults: {injected} injected {counts}; done {summary.done}/80, "
          f"failed {summary.failed}")
    assert injected >= 4
    assert (summary.done, summary.failed) == (80, 0)
    assert contents(faulty_dir / "out") == contents(clean_dir / "out")
    assert_each_planned_id_once(faulty_dir / "out", 80)


def test_engine_killed_and_restarted_twice_mid_run(
    engine_installed: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = LocalEngine(tiny_model_dir, log_path=tmp_path / "engine.log")
    assert engine.pid is None
    engine.start()
    job = job_file(tmp_path, engine.url, n=160, max_tokens=64, conc=16)
    out = tmp_path / "out"
    run = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        for threshold in (40, 100):
            wait_for(lambda t=threshold: ledger_lines(out) >= t)
            pgid = engine.pid
            assert pgid is not None
            engine.kill()
            # Killed as a crash would: the whole group at once, the port closed.
            assert engine.pid is None
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)
            with (pytest.raises(ConnectionRefusedError),
                  socket.create_connection(("127.0.0.1", engine.port), timeout=5)):
                pass
            time.sleep(2)
            engine = LocalEngine(tiny_model_dir, port=engine.port,
                                 log_path=tmp_path / f"engine-{threshold}.log")
            engine.start()
        stdout, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
        engine.stop()
    print(f"RELIABILITY engine restarts: 2 survived; {stdout.strip()}")
    assert run.returncode == 0, stderr
    assert "160/160 done, 0 failed" in stdout
    assert "down since" in stderr  # the outage was visible in progress
    assert_each_planned_id_once(out, 160)
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    events = manifest["runs"][-1]["events"]
    assert sum("up again" in e for e in events) >= 2


def test_a_hung_engine_is_caught_by_the_watchdog(local_engine: LocalEngine,
                                                 tmp_path: Path) -> None:
    job = job_file(tmp_path, local_engine.url, n=120, max_tokens=48, conc=8,
                   client="hang_timeout_s: 3, probe_timeout_s: 2, ")
    out = tmp_path / "out"
    run = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ledger_lines(out) >= 30)
        local_engine.suspend()
        # Frozen: connections open, nothing answers.
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(f"{local_engine.url}/health", timeout=2)
        time.sleep(6)
    finally:
        local_engine.resume()
    stdout, stderr = run.communicate(timeout=600)
    print(f"RELIABILITY hang: engine stopped 8s with SIGSTOP; {stdout.strip()}")
    assert run.returncode == 0, stderr
    assert "120/120 done, 0 failed" in stdout
    assert "hung" in stderr
    assert_each_planned_id_once(out, 120)


def test_sigkill_at_ten_random_moments(local_engine: LocalEngine, tmp_path: Path) -> None:
    n = 300
    job = job_file(tmp_path, local_engine.url, n=n, max_tokens=32, conc=16)
    out = tmp_path / "out"
    moments = sorted(random.Random(42).sample(range(5, n - 10), 10))
    kills = 0
    for moment in moments:
        proc = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        with contextlib.suppress(AssertionError):
            wait_for(lambda m=moment, p=proc: ledger_lines(out) >= m or p.poll() is not None, 120)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait(timeout=60)
    final = draftgen("run", str(job))
    status = orjson.loads(draftgen("status", str(out), "--json").stdout)
    print(f"RELIABILITY kills: {kills} SIGKILLs; after rerun done {status['done']}/{n}, "
          f"failed {status['failed']}")
    assert kills >= 8
    assert final.returncode == 0, final.stderr
    assert (status["done"], status["failed"], status["pending"]) == (n, 0, 0)
    assert_each_planned_id_once(out, n)
    for r in shard_records(out):
        assert r["turns"][0]["completion_tokens"] == 32


def test_sigint_finishes_in_flight_and_a_second_signal_aborts(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    # 24 samples: a wave before the graceful stop, one before the abort, the rest after.
    job = job_file(tmp_path, local_engine.url, n=24, max_tokens=1024, conc=4)
    out = tmp_path / "out"
    graceful = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    wait_for(lambda: ledger_lines(out) >= 4)
    graceful.send_signal(signal.SIGINT)
    stdout, _ = graceful.communicate(timeout=120)
    assert graceful.returncode == 0
    assert "stopped: SIGINT" in stdout and stdout.count("\n") == 1
    done_after_grace = ledger_lines(out)

    abort = subprocess.Popen([*PY, "run", str(job)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    wait_for(lambda: ledger_lines(out) >= done_after_grace + 4)
    t0 = time.monotonic()
    abort.send_signal(signal.SIGINT)
    time.sleep(0.3)
    abort.send_signal(signal.SIGTERM)
    stdout, _ = abort.communicate(timeout=120)
    took = time.monotonic() - t0
    assert abort.returncode == 0 and "aborted" in stdout
    assert took < 10  # in-flight answers of 1,024 tokens were cut, not awaited
    final = draftgen("run", str(job))
    assert "24/24 done, 0 failed" in final.stdout
    assert_each_planned_id_once(out, 24)
    print(f"RELIABILITY signals: graceful stop + abort ({took:.1f}s); {final.stdout.strip()}")


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full disk is simulated with a tmpfs mount, which needs root: "
                    f"{mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_stops_the_run_and_a_rerun_after_freeing_space_completes(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    job = job_file(tmp_path, local_engine.url, n=200, max_tokens=64, conc=8)
    with small_disk(tmp_path / "disk", 1024) as disk:
        out = disk / "out"
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (1024 - 120) * 1024)
        full = draftgen("run", str(job), "--out", str(out))
        assert full.returncode == 1, full.stdout + full.stderr
        assert "no space left on device" in full.stderr
        assert "Traceback" not in full.stderr
        before = orjson.loads(draftgen("status", str(out), "--json").stdout)["done"]
        assert 0 < before < 200
        filler.unlink()
        again = draftgen("run", str(job), "--out", str(out))
        assert again.returncode == 0, again.stderr
        assert "200/200 done, 0 failed" in again.stdout
        assert_each_planned_id_once(out, 200)
    print(f"RELIABILITY disk: ENOSPC after {before} samples; after freeing space: "
          f"{again.stdout.strip()}")


def test_bad_input_is_set_aside_with_reasons_and_the_run_goes_on(
    local_engine: LocalEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bad: list[dict[str, object]] = [
        b'{"id": 900, "messages": [ {"role": "user"',  # type: ignore[list-item]
        {"id": 901},
        {"id": 902, "messages": "not a list"},
        {"id": 903, "messages": [{"role": "user", "content": "   "}]},
        {"id": 904, "messages": [{"role": "assistant", "content": "hi"}]},
        {"id": 905, "messages": [{"role": "user", "content": 42}]},
        {"id": 906, "messages": [{"role": "user", "content": "word " * 9000}]},
    ]
    job = job_file(tmp_path, local_engine.url, n=20, max_tokens=8, conc=4, rows=bad,
                   extra=f"tokenizer: {tiny_model_dir / 'tokenizer.json'}\n")
    out = tmp_path / "out"
    plan = orjson.loads(draftgen("plan", str(job), "--json").stdout)
    assert len(plan["rejected"]) == 6
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "20/20 done, 0 failed" in ran.stdout
    rejected = [orjson.loads(x) for x in (out / "rejected.jsonl").read_bytes().splitlines()]
    reasons = sorted(r["reason"].split(":")[0] for r in rejected)
    assert reasons == ["empty_prompt", "invalid_roles", "malformed_json", "missing_field",
                       "prompt_too_long", "wrong_type", "wrong_type"]
    assert all(r["source"].endswith("p.jsonl") and r["row"] > 20 for r in rejected)
    st = orjson.loads(draftgen("status", str(out), "--json").stdout)
    assert st["rejected"] == 7
    assert st["set_aside"] == {"rows": 6, "too_long": 1}
    print(f"RELIABILITY bad input: {len(rejected)} rows set aside ({', '.join(reasons)}); "
          f"{ran.stdout.strip()}")


def test_prompts_over_the_context_are_set_aside_or_shortened_by_the_engines_own_count(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    """No tokenizer in the job: a prompt of digits is one token per character, four times
    the planner's estimate. The engine's /tokenize decides before anything is sent: the
    one over the context is set aside, the one that leaves too little room for max_tokens
    is sent with what fits, and nothing fails."""
    rows: list[dict[str, object]] = [
        {"id": 950, "messages": [{"role": "user", "content": "7" * 6000}]},
        {"id": 951, "messages": [{"role": "user", "content": "7" * 3600}]},
    ]
    job = job_file(tmp_path, local_engine.url, n=4, max_tokens=600, conc=4, rows=rows)
    out = tmp_path / "out"
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "5/5 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    [rejected] = [orjson.loads(x) for x in (out / "rejected.jsonl").read_bytes().splitlines()]
    assert rejected["reason"].startswith("prompt_too_long: 60")  # ~6,000 counted tokens
    plan = {p["id"]: p for p in map(orjson.loads, (out / "plan.jsonl").read_bytes().split())}
    short = plan["q-951"]
    assert short["prompt_tokens"] > 3600 and short["max_tokens"] < 600
    assert short["prompt_tokens"] + short["max_tokens"] == local_engine.max_model_len
    [record] = [r for r in shard_records(out) if r["id"] == "q-951"]
    assert record["turns"][0]["completion_tokens"] == short["max_tokens"]
    print(f"RELIABILITY over the context: 1 set aside ({rejected['reason']}), 1 sent with "
          f"max_tokens {short['max_tokens']} instead of 600; {ran.stdout.strip()}")

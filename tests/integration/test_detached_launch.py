"""A job that launches its own server from a profile, run detached, watched, stopped, resumed."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from test_pipeline import draftgen

REPO = Path(__file__).resolve().parents[2]
# 48 answers of 256 tokens, 2 at a time: ~6,000 engine steps, so even an engine ~8x faster
# than a 2-core EPYC without AVX-512 (~50 s here) is still generating when the test stops it
# (once 2 are done, a status read a second apart).
N = 48


# Two engine launches (about 20-40 s each here) and a run: more than the default limit.
@pytest.mark.timeout(900)
def test_detached_run_with_an_embedded_server_stops_and_resumes(
    engine_installed: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "local.yaml"
    profile.write_text((REPO / "examples" / "profiles" / "local-cpu.yaml").read_text()
                       .replace("../../.cache/tiny-model", str(tiny_model_dir)))
    rows = [{"id": i, "messages": [{"role": "user", "content": f"Count to {i}."}]}
            for i in range(N)]
    (tmp_path / "p.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    job = tmp_path / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{{launch: {profile}}}]
sampling: {{temperature: 0, extra_body: {{ignore_eos: true}}}}
partitions: {{p: {{max_tokens: 256, concurrency: 2}}}}
categories: [{{name: c, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
output: out
progress_interval_s: 1
""")
    out = tmp_path / "out"
    started = draftgen("run", str(job), "--detach")
    assert started.returncode == 0 and "started in the background" in started.stdout

    deadline = time.monotonic() + 400
    while True:
        st = orjson.loads(draftgen("status", str(out), "--json").stdout or b"{}") \
            if (out / "plan.jsonl").exists() else {}
        if st.get("running") and st.get("done", 0) >= 2:
            break
        assert time.monotonic() < deadline, (out / "run.log").read_text()
        time.sleep(1)
    assert st["pid"] is not None and 0 < st["done"] < N
    human = " ".join(draftgen("status", str(out)).stdout.split())  # the title may wrap
    assert f"running (pid {st['pid']})" in human

    stopped = draftgen("stop", str(out))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    st = orjson.loads(draftgen("status", str(out), "--json").stdout)
    assert st["running"] is False and st["pid"] is None
    log = (out / "run.log").read_text()
    assert "stopped: SIGTERM" in log
    # The launched engine was stopped with the run: its pid file is gone, its state says so.
    [server_dir] = (out / "servers").iterdir()
    assert not (server_dir / "server.pid").exists()
    assert orjson.loads((server_dir / "state.json").read_bytes())["status"] == "stopped"

    # The resume may go faster: concurrency is not part of any request, so no sample
    # counts as changed.
    job.write_text(job.read_text().replace("concurrency: 2", "concurrency: 16"))
    final = draftgen("run", str(job))
    assert final.returncode == 0, final.stderr
    assert f"{N}/{N} done, 0 failed" in final.stdout
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    server = manifest["runs"][-1]["servers"][0]
    assert server["verified"] is True and server["kv_dtype"] == "bfloat16"
    assert server["profile_hash"] and server["engine"] == "vllm"
    # vLLM publishes no running limit; the one the profile launched it with is used as told.
    told = "runs at most 8 requests at once (the profile draftgen launched it with)"
    assert any(told in e for e in manifest["runs"][-1]["events"]), manifest["runs"][-1]

"""`draftgen tune` on the real local engine, for a job whose best setting is not the default.

The reference profile limits vLLM to 2 running requests while the demo job keeps 20 in
flight; one candidate raises the limit to 16, another does the same with an fp8 KV cache,
which the profile's quality override lets the tune try. Each is launched, verified,
probed against the reference's recorded answers and measured with the job's own requests.
The tune must pick the raised limit, and the probe must throw the fp8 candidate out
whatever its speed. Run again, it measures nothing and gives the same answer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftgen.job import load_job
from draftgen.servers import load_profile
from draftgen.tune import TuneOptions, format_table, tune

REPO = Path(__file__).resolve().parents[2]
DEMO_JOB = REPO / "examples" / "demo" / "job.yaml"
RAISED = "max_running_requests=16"
LOSSY = "max_running_requests=16, kv_cache_dtype=fp8"

TUNE_SECTION = """
max_running_requests: 2
quality: {allow_lossy_kv_cache: true, reason: "test: the probe must reject it"}
tune:
  candidates:
    - {max_running_requests: 16}
    - {max_running_requests: 16, kv_cache_dtype: fp8}
"""


# Three engine launches (about 20-40 s each here), a probe and a short window each.
@pytest.mark.timeout(900)
async def test_tune_picks_a_faster_passing_candidate_and_the_probe_rejects_fp8(
    engine_installed: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "reference.yaml"
    example = (REPO / "examples" / "profiles" / "local-cpu.yaml").read_text()
    profile.write_text(re.sub(r"(?m)^max_running_requests:.*$", "", example)
                       .replace("../../.cache/tiny-model", str(tiny_model_dir))
                       + TUNE_SECTION)
    job = load_job(DEMO_JOB)
    events: list[str] = []
    opts = TuneOptions(budget_s=900, tune_dir=tmp_path / "tune", measure_s=6, warmup_s=2,
                       max_rungs=1, probe_n=12, probe_max_tokens=24, launch_timeout_s=300,
                       on_event=events.append)
    result = await tune(profile, job, opts)
    table = format_table(result)
    rows = {r.label: r for r in result.rows}
    ref, raised, lossy = rows["reference"], rows[RAISED], rows[LOSSY]
    assert ref.status == "measured", table

    # The raised limit passes the probe (lossless) and the job runs faster on it.
    assert raised.status == "measured" and raised.verdict == "pass", table
    assert result.best is not None and result.best.label == RAISED, table
    assert raised.ratio is not None and raised.ratio < 1, table
    assert result.saving_s is not None and result.saving_s > 0
    assert raised.tok_s is not None and ref.tok_s is not None and raised.tok_s > ref.tok_s

    # fp8 KV was tried (the override allows it), holds twice the tokens, and is out.
    assert lossy.status == "rejected" and lossy.verdict == "FAIL", table
    assert "probe:" in lossy.note and lossy.probe_top1 is not None and lossy.probe_top1 < 0.97
    assert ref.kv_tokens and lossy.kv_tokens == 2 * ref.kv_tokens

    best = load_profile(result.best_profile or tmp_path / "missing")
    assert best.max_running_requests == 16 and best.kv_cache_dtype == "bfloat16"
    assert result.plot is not None and result.plot.read_bytes()[:4] == b"\x89PNG"
    for server in (tmp_path / "tune" / "servers").iterdir():
        assert not (server / "server.pid").exists(), f"{server.name} was left running"

    # Again: every trial is in the tune directory, so nothing is launched or measured.
    trials = (tmp_path / "tune" / "tune.jsonl").read_bytes()
    events.clear()
    again = await tune(profile, job, opts)
    assert (tmp_path / "tune" / "tune.jsonl").read_bytes() == trials
    assert not any("launching" in e for e in events), events
    assert again.best is not None and again.best.label == RAISED

"""`draftgen tune` on the real local engine, for a job whose best setting is not the default.

The reference profile limits vLLM to 2 running requests while the demo job keeps 20 in
flight; one candidate raises the limit to 16, one does the same serving a copy of the model
with its weights rounded to 4 bits (lossy on any machine), and one with an fp8 KV cache,
which the profile's quality override lets the tune try. Each is launched, verified, probed
against the reference's recorded answers and measured with the job's own requests. The tune
must pick the raised limit, and the probe must throw the lossy candidates out whatever their
speed. Where the engine cannot run fp8 KV here (vLLM's CPU build without AVX-512 or AMX),
the table must say the engine refused it — told from the trial's outcome, not the CPU's
flags — and never count it as failed or as rejected by the probe. Run again, it measures
nothing and gives the same answer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftgen.job import load_job
from draftgen.servers import load_profile
from draftgen.tune import TuneOptions, format_table, tune

REPO = Path(__file__).resolve().parents[2]
DEMO_JOB = REPO / "examples" / "demo" / "job-tiny.yaml"
RAISED = "max_running_requests=16"
LOSSY = "max_running_requests=16, kv_cache_dtype=fp8"

TUNE_SECTION = """
max_running_requests: 2
quality: {{allow_lossy_kv_cache: true, reason: "test: the probe must reject it"}}
tune:
  candidates:
    - {{max_running_requests: 16}}
    - {{max_running_requests: 16, model_path: "{rounded}"}}
    - {{max_running_requests: 16, kv_cache_dtype: fp8}}
"""


# Up to four engine launches (about 20-40 s each here), a probe and a short window each.
@pytest.mark.timeout(900)
async def test_tune_picks_a_faster_passing_candidate_and_the_probe_rejects_lossy_ones(
    engine_installed: None, tiny_model_dir: Path, rounded_model_dir: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "reference.yaml"
    example = (REPO / "examples" / "profiles" / "local-cpu.yaml").read_text()
    profile.write_text(re.sub(r"(?m)^max_running_requests:.*$", "", example)
                       .replace("../../.cache/tiny-model", str(tiny_model_dir))
                       + TUNE_SECTION.format(rounded=rounded_model_dir))
    job = load_job(DEMO_JOB)
    events: list[str] = []
    opts = TuneOptions(budget_s=900, tune_dir=tmp_path / "tune", measure_s=6, warmup_s=2,
                       max_rungs=1, probe_n=12, probe_max_tokens=24, launch_timeout_s=300,
                       on_event=events.append)
    result = await tune(profile, job, opts)
    table = format_table(result)
    print(table)
    rows = {r.label: r for r in result.rows}
    ref, raised, lossy = rows["reference"], rows[RAISED], rows[LOSSY]
    (rounded,) = (r for r in result.rows if "model_path=" in r.label)
    assert ref.status == "measured", table

    # The raised limit passes the probe (lossless) and the job runs faster on it.
    assert raised.status == "measured" and raised.verdict == "pass", table
    assert result.best is not None and result.best.label == RAISED, table
    assert raised.ratio is not None and raised.ratio < 1, table
    assert result.saving_s is not None and result.saving_s > 0
    assert raised.tok_s is not None and ref.tok_s is not None and raised.tok_s > ref.tok_s

    # Weights rounded to 4 bits: launched, measured, and out by the probe whatever its speed.
    assert rounded.status == "rejected" and rounded.verdict == "FAIL", table
    assert "probe:" in rounded.note, table
    assert rounded.probe_top1 is not None and rounded.probe_top1 < 0.97, table
    assert rounded.tok_s is not None and rounded.tok_s > 0, table

    # fp8 KV was tried (the override allows it). Where the engine runs it, it holds twice
    # the tokens and the probe throws it out; where the engine cannot (this CPU), the table
    # says the engine refused it, and that is neither a failure nor a probe verdict.
    if lossy.status == "refused":
        assert lossy.note.startswith("engine refused: "), table
        assert re.search(r"fp8", lossy.note, re.IGNORECASE), table
        assert lossy.verdict == "-" and lossy.probe_top1 is None and lossy.tok_s is None
        assert "engine refused: " in table
    else:
        assert lossy.status == "rejected" and lossy.verdict == "FAIL", table
        assert "probe:" in lossy.note and lossy.probe_top1 is not None \
            and lossy.probe_top1 < 0.97, table
        assert ref.kv_tokens and lossy.kv_tokens == 2 * ref.kv_tokens

    best = load_profile(result.best_profile or tmp_path / "missing")
    assert best.max_running_requests == 16 and best.kv_cache_dtype == "bfloat16"
    assert best.model_path == str(tiny_model_dir)
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

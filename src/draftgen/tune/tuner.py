"""`draftgen tune PROFILE --job JOB`: the fastest server configuration that passes the probe,
for this job, within a time budget.

    the reference profile + the job's plan → the grid (candidates.py)
    → successive halving (search.py), each trial launched, verified, probed against the
      reference and measured with the job's own requests (measure.py), its job duration
      predicted by the capacity model (predict.py), recorded in the tune directory (directory.py)
    → the table, the best profile written, speed against drift (result.py)

The reference is the profile as given: every candidate is compared with it, measured the
same way and close in time, and must generate what it generates (the A/B probe).

The tune directory is keyed (`tune_key`) by everything a trial depends on: the reference
profile's settings (`profile_hash`), its `tune:` section (the draft model of speculative
decoding included, which `profile_hash` leaves out), the engine release its interpreter
has, the job's requests, the measurement's options and the probe's sizes and thresholds
(a trial's verdict is the probe's as it was). Any of them changed, the directory is
refused rather than its trials reused for what they did not measure.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from draftgen.clock import REAL_CLOCK, Clock, format_duration
from draftgen.engines.install import EngineInstall
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.job import JobSpec, read_api_key
from draftgen.planning.measured import measure_from_run
from draftgen.planning.plan import build_plan
from draftgen.probe.drift import ProbeThresholds
from draftgen.probe.gate import GateSettings
from draftgen.reporting.plots import PlotError
from draftgen.sample import Sample, base_body
from draftgen.servers.policy import check_profile
from draftgen.servers.preflight import read_available_memory
from draftgen.servers.profile import ServerProfile, load_profile, profile_hash
from draftgen.tune.candidates import (
    REFERENCE,
    HostFacts,
    build_grid,
    config_path,
    is_mla_model,
    not_binding,
)
from draftgen.tune.directory import Trial, TuneDir
from draftgen.tune.levers import apply_levers
from draftgen.tune.measure import Measurer, MeasureSettings
from draftgen.tune.predict import JobModel
from draftgen.tune.referee import load_reference
from draftgen.tune.result import (
    Row,
    TuneResult,
    build_rows,
    draw_speed_vs_drift,
    provenance,
    write_profile,
)
from draftgen.tune.search import SearchOptions, SearchOutcome, search
from draftgen.tune.window import interleaved


@dataclass(frozen=True)
class TuneOptions:
    budget_s: float = 1800.0
    # Default: next to the job's output, `<output>-tune-<profile name>`.
    tune_dir: Path | None = None
    # The best profile; default: <tune_dir>/best.yaml.
    write: Path | None = None
    measure_s: float = 20.0  # the first rung's window; each later rung `eta` times longer
    warmup_s: float = 5.0
    eta: int = 2
    max_rungs: int = 3
    margin: float = 0.03
    # The probe's size; None: the profile's `quality.probe` (16 prompts, 32 tokens, top-10).
    probe_n: int | None = None
    probe_max_tokens: int | None = None
    probe_top_k: int | None = None
    thresholds: ProbeThresholds = field(default_factory=ProbeThresholds)
    launch_timeout_s: float = 1800.0
    # A finished or partial run of this job: its answer lengths feed the predictions.
    lengths_from: Path | None = None
    plot: bool = True
    clock: Clock = REAL_CLOCK
    on_event: Callable[[str], None] | None = None


def default_tune_dir(job: JobSpec, profile: ServerProfile) -> Path:
    out = job.resolve(job.output).resolve()
    return out.parent / f"{out.name}-tune-{profile.server_name}"


def tune_key(reference: ServerProfile, install: EngineInstall, job: str,
             opts: TuneOptions) -> dict[str, Any]:
    """What the tune directory is for (see the module docstring): `tune.json`."""
    section = (reference.tune.model_dump(mode="json", exclude_defaults=True)
               if reference.tune is not None else None)
    probe = reference.quality.probe
    return {
        "profile": profile_hash(reference),
        "tune section": section,
        "engine": f"{install.engine} {install.version or '(not found)'}",
        "job": job,
        "measurement": {"measure_s": opts.measure_s, "warmup_s": opts.warmup_s,
                        "eta": opts.eta},
        # Its sizes as this tune runs them, the gate's thresholds and the prefill path's.
        "probe": {**probe.model_dump(mode="json"), "prompts": opts.probe_n or probe.prompts,
                  "max_tokens": opts.probe_max_tokens or probe.max_tokens,
                  "top_k": opts.probe_top_k or probe.top_k,
                  "prefill": asdict(opts.thresholds)},
    }


def job_digest(job: JobSpec, samples: Sequence[Sample]) -> str:
    """Changes when the requests the job sends, or its concurrency, change."""
    data = [job.model, {n: p.concurrency for n, p in job.partitions.items()},
            [s.fingerprint for s in samples]]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]


async def tune(profile_path: Path, job: JobSpec, opts: TuneOptions) -> TuneResult:
    """Tune the profile's server for the job (see the module docstring).

    Raises JobError for a bad profile, job or tune directory, QualityPolicyError when the
    reference profile itself is refused, DiskError when the tune directory cannot be written.
    A candidate that fails in any way is a row of the result, not an exception.
    """
    reference = load_profile(profile_path)
    check_profile(reference)
    probe = reference.quality.probe
    opts = replace(opts, probe_n=opts.probe_n or probe.prompts,
                   probe_max_tokens=opts.probe_max_tokens or probe.max_tokens,
                   probe_top_k=opts.probe_top_k or probe.top_k)
    gate = GateSettings(confidence=probe.confidence, kl_margin=probe.kl_margin,
                        top1_margin=probe.top1_margin, detect_kl=probe.detect_kl,
                        cache_read=probe.cache_read)
    plan = build_plan(job)
    if not plan.samples:
        raise JobError(f"{job.source_file or 'job'}: the plan has no samples to measure with")
    samples = plan.samples
    concurrency = {name: p.concurrency for name, p in job.partitions.items()}
    store = TuneDir(opts.tune_dir or default_tune_dir(job, reference))
    install = await asyncio.to_thread(engine_for(reference.engine).installed,
                                      reference.interpreter)
    recorded = store.open(tune_key(reference, install, job_digest(job, samples), opts))
    if load_reference(store.reference_probe) is None:
        # Its probe answers are gone: the reference's first trial is run again to record them.
        recorded = [t for t in recorded if not (t.candidate == REFERENCE and t.rung == 0)]
    host = HostFacts(available_bytes=read_available_memory(), install=install,
                     mla=is_mla_model(config_path(reference)))
    total = sum(concurrency.values())
    grid = build_grid(reference, total, host)
    ordered = interleaved(samples)
    known = measure_from_run(opts.lengths_from).output_tokens if opts.lengths_from else {}
    model = JobModel(samples, concurrency, job.seed, known)
    say = opts.on_event
    if say is not None:
        say(f"tune: {len(grid) - 1} candidate(s) against the reference "
            f"({install.describe()}); budget {format_duration(opts.budget_s)}; "
            f"trials in {store.path}")
    measurer = Measurer(MeasureSettings(
        reference=reference, tune_dir=store, model=job.model, samples=ordered,
        base=base_body(job.model, job.sampling.model_dump()), concurrency=concurrency,
        probe_prompts=[list(s.messages) for s in ordered[:opts.probe_n]],
        probe_max_tokens=opts.probe_max_tokens or probe.max_tokens,
        probe_top_k=opts.probe_top_k or probe.top_k,
        thresholds=opts.thresholds, gate=gate, warmup_s=opts.warmup_s,
        launch_timeout_s=opts.launch_timeout_s, api_key=read_api_key(job), clock=opts.clock,
        on_event=say))
    space = reference.tune
    outcome = await search(
        grid, measurer, recorded=recorded, record=store.append, objective=model.seconds,
        opts=SearchOptions(budget_s=opts.budget_s, base_s=opts.measure_s, eta=opts.eta,
                           max_rungs=opts.max_rungs, margin=opts.margin,
                           combine=space.combine if space is not None else True),
        clock=opts.clock, skip=not_binding(reference, model.kv_demand))
    return _result(profile_path, job, reference, store, outcome, model, opts)


def _result(profile_path: Path, job: JobSpec, reference: ServerProfile, store: TuneDir,
            outcome: SearchOutcome, model: JobModel, opts: TuneOptions) -> TuneResult:
    trials = list(outcome.trials)

    def value(t: Trial) -> float | None:
        return model.seconds(t, trials, rejected_too=True)

    rows = build_rows(outcome.candidates, trials, value,
                      lambda mine, ref: model.explain(mine, ref, trials))
    ref_row = rows[0]
    best_row = next((r for r in rows if outcome.best is not None
                     and r.candidate == outcome.best.id), None)
    saving = None
    if outcome.best_trial is not None and outcome.reference_trial is not None:
        mine, ref = value(outcome.best_trial), value(outcome.reference_trial)
        saving = ref - mine if mine is not None and ref is not None else None
    notes: list[str] = list(outcome.notes)
    notes += [f"{r.label}: {r.why}" for r in rows if r.why]
    if ref_row.status != "measured":
        notes.append(f"the reference could not be measured ({ref_row.note}): nothing to "
                     "compare with")
    written = None
    if ref_row.status == "measured":
        chosen = outcome.best
        profile = apply_levers(reference, chosen.levers) if chosen else reference
        what = (f"{chosen.label}" if chosen else "the reference's own settings (no candidate "
                "beat it)")
        predicted = (f"Predicted job duration {format_duration(best_row.predicted_s)} against "
                     f"{format_duration((best_row.predicted_s or 0) + (saving or 0))} for the "
                     "reference." if best_row is not None else
                     f"Predicted job duration {format_duration(ref_row.predicted_s)}.")
        written = write_profile(opts.write or store.path / "best.yaml", profile,
                                provenance(profile_path, job.source_file, what, predicted))
    plot = None
    if opts.plot and any(r.first_tok_s is not None for r in rows):
        try:
            plot = draw_speed_vs_drift(rows, opts.thresholds, best_row, store.path / "tune.png")
        except PlotError as e:
            notes.append(f"no plot: {e}")
    if best_row is not None and best_row.rung == 0 and opts.max_rungs > 1:
        notes.append("the best was measured once, briefly: give a larger budget to measure "
                     "it again, longer, beside the reference")
    notes += _lossy_notes(rows)
    return TuneResult(store.path, tuple(rows), ref_row, best_row, written, plot, saving,
                      outcome.spent_s, opts.budget_s, outcome.budget_stopped, tuple(notes))


def _lossy_notes(rows: Sequence[Row]) -> list[str]:
    out = []
    for r in rows:
        if r.verdict == "FAIL" and r.ratio is not None and r.ratio < 1:
            out.append(f"{r.label} would have been {1 / r.ratio:.2f}× as fast, but fails the "
                       "probe: it changes what the model writes")
    return out


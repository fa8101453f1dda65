"""`draftgen plan --server/--from-run/--profile [--budget]`: how long the plan will take, and
caps that fit a time budget.

Measurements come from a short calibration against a server, from a finished or partial
run, or both (a run's lengths with a server's speed); or, before any server exists, from a
profile: its KV capacity from the memory model (`servers/prediction.py`) and the decode
speed its `speed:` section states (else the capacity model's assumed shape, said so).
What-if levers override what was measured: `--kv-tokens` (say, after doubling memory or
enabling dp-attention) and `--servers` (replicas).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.clock import format_duration
from draftgen.engines.memory import MemoryModelError
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.job import JobSpec
from draftgen.planning.budget import CapPlan, fit_caps
from draftgen.planning.calibrate import calibrate, concurrency_levels_for
from draftgen.planning.capacity import Prediction, predict
from draftgen.planning.measured import Measured, measure_from_run
from draftgen.planning.plan import Plan
from draftgen.planning.workload import DecodeSpeed, Workload
from draftgen.sample import base_body
from draftgen.servers.prediction import ProfileMemory, memory_facts, predict_profile
from draftgen.servers.profile import ServerProfile

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'48h', '90m', '2d12h', '3600' (seconds) → seconds."""
    parts = re.fullmatch(r"\s*((\d+(\.\d+)?)\s*[smhd]?\s*)+", text)
    if not parts:
        raise JobError(f"--budget: {text!r} is not a duration like 48h, 90m or 2d12h")
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", text):
        total += float(num) * _UNITS[unit or "s"]
    return total


@dataclass(frozen=True, slots=True)
class Forecast:
    measured: Measured
    prediction: Prediction
    caps: CapPlan | None

    def lines(self) -> list[str]:
        p = self.prediction
        s = p.steady
        out = [
            f"measured: {self.measured.source}"
            + "".join(f"\n  note: {n}" for n in (*self.measured.notes, *p.notes)),
            f"servers: {p.server.servers} × {p.server.kv_tokens:,} KV tokens",
            f"steady state: {s.running:.1f} running per server ({s.bound}-bound; a request "
            f"holds ~{s.footprint_tokens:,.0f} KV tokens), {s.tok_s:,.0f} output tok/s",
            f"predicted: {p.samples:,} samples, {p.output_tokens:,} output tokens in "
            f"{format_duration(p.duration_s)} ({p.tok_s:,.0f} tok/s; tail after 90% "
            f"{format_duration(p.tail_s)}; ~{p.preemptions:,} preemptions)",
            *(f"  partition {g.name}: {g.samples:,} samples, done after "
              f"{format_duration(g.duration_s)}" for g in p.partitions),
        ]
        if p.unservable:
            out.append(f"  {p.unservable:,} samples' prompts do not fit a server's cache")
        if self.caps is not None:
            c = self.caps
            budget = format_duration(c.budget_s)
            if not c.reduced:
                out.append(f"fits the {budget} budget without caps")
            else:
                out.append(f"caps to fit {budget} ({c.mode}): predicted "
                           f"{format_duration(c.prediction.duration_s)}")
                out += [f"  {cat}: {c.prompts[cat]:,} → {n:,} prompts"
                        for cat, n in c.reduced.items()]
        return out


def measured_from_profile(profile: ServerProfile, facts: ProfileMemory | None = None,
                          **changes: Any) -> Measured:
    """What a server of `profile` would measure, predicted: its KV tokens (with `changes`,
    e.g. another fraction or layout), its running limit, the decode speed it states."""
    facts = facts or memory_facts(profile)
    kv = predict_profile(profile, facts, **changes)
    speed = (DecodeSpeed(tuple(profile.speed.points), None,
                         profile.speed.source or "the profile's speed points")
             if profile.speed else DecodeSpeed.assumed())
    notes = (f"KV: {kv.describe()}", *facts.sources(),
             f"decode speed: {speed.source} (assumed: the model's step time depends only on "
             "the running requests, extrapolated beyond the last point)")
    return Measured(speed=speed, kv_tokens=kv.kv_tokens,
                    max_running=engine_for(profile.engine).running_limit(profile),
                    source=f"predicted for {profile.source_file or profile.model_path}",
                    notes=notes)


async def measure(job: JobSpec, *, server: str | None, from_run: Path | None,
                  api_key: str | None, profile: ServerProfile | None = None) -> Measured:
    measured: Measured | None = None
    if from_run is not None:
        measured = measure_from_run(from_run)
    if profile is not None:
        try:
            predicted = measured_from_profile(profile)
        except MemoryModelError as e:
            raise JobError(f"--profile: {e}") from None
        measured = predicted if measured is None else measured.with_server_from(predicted)
    if server is not None:
        total = sum(p.concurrency for p in job.partitions.values())
        sampling = base_body(job.model, job.sampling.model_dump())
        calibrated = await calibrate(server, job.model, sampling=sampling, api_key=api_key,
                                     concurrency_levels=concurrency_levels_for(total))
        measured = calibrated if measured is None else measured.with_server_from(calibrated)
    if measured is None:
        raise JobError("--budget and the what-if flags need measurements: give --server URL "
                       "(a short calibration), --from-run OUT or --profile PROFILE")
    return measured


def forecast(job: JobSpec, plan: Plan, measured: Measured, *, kv_tokens: int | None,
             servers: int | None, budget_s: float | None, mode: str,
             priority: Sequence[str]) -> Forecast:
    try:
        server = measured.server_capacity(kv_tokens=kv_tokens, servers=servers)
    except ValueError as e:
        raise JobError(f"--kv-tokens: {e}") from None
    workload = Workload.from_samples(
        plan.samples, {n: p.concurrency for n, p in job.partitions.items()},
        output_samples=measured.output_tokens)
    prediction = predict(server, workload, seed=job.seed)
    caps = None
    if budget_s is not None:
        try:
            caps = fit_caps(plan.summary_rows(), prediction, budget_s,
                            mode=mode, priority=priority)  # type: ignore[arg-type]
        except ValueError as e:
            raise JobError(f"--budget: {e}") from None
    return Forecast(measured, prediction, caps)

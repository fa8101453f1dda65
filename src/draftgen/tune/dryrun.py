"""`draftgen tune --dry-run`: the grid a tune would try, each candidate predicted before any
launch — KV tokens from the memory model, the running requests and the job's duration from
the capacity model with the profile's stated decode speed — and where it can be measured.

Levers the memory model does not see (speculative decoding, prefill chunk, prefix cache,
HiCache, the compute dtype, other weights) change no prediction here: their row says so, and
only a measurement can tell.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftgen.clock import format_duration
from draftgen.engines.memory import MemoryModelError
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.job import JobSpec
from draftgen.planning.forecast import forecast, measured_from_profile
from draftgen.planning.plan import build_plan
from draftgen.servers.policy import check_profile
from draftgen.servers.prediction import ProfileMemory, memory_facts
from draftgen.servers.preflight import read_available_memory
from draftgen.servers.profile import load_profile
from draftgen.tune.candidates import (
    HostFacts,
    build_grid,
    config_path,
    is_cpu_build,
    is_mla_model,
)
from draftgen.tune.levers import apply_levers

# Levers whose effect the memory and capacity models cannot predict.
UNSEEN = ("speculative", "speculative_adaptive", "chunked_prefill", "prefix_cache",
          "hicache_gb_per_rank", "model_dtype", "model_path")


@dataclass(frozen=True)
class DryRow:
    label: str
    kv_tokens: int | None
    running: float | None
    bound: str
    duration_s: float | None
    where: str  # where it can be measured
    note: str = ""


def dry_run(profile_path: Path, job: JobSpec) -> tuple[list[DryRow], list[str]]:
    """The rows, and what every prediction rests on."""
    reference = load_profile(profile_path)
    check_profile(reference)
    plan = build_plan(job)
    install = engine_for(reference.engine).installed(reference.interpreter)
    host = HostFacts(available_bytes=read_available_memory(), install=install,
                     mla=is_mla_model(config_path(reference)))
    grid = build_grid(reference, sum(p.concurrency for p in job.partitions.values()), host)
    header = [f"engine: {install.describe()}"]
    facts: ProfileMemory | None = None
    try:
        facts = memory_facts(reference)
        header += facts.sources()
    except MemoryModelError as e:
        header.append(f"no memory model for this profile: {e}")
    rows = []
    for cand in grid:
        try:
            profile = apply_levers(reference, cand.levers)
        except JobError as e:
            rows.append(DryRow(cand.label, None, None, "", None, "-", f"invalid: {e}"))
            continue
        where = "this machine" if is_cpu_build(profile) else "a GPU machine"
        unseen = [k for k in cand.levers.changes() if k in UNSEEN]
        note = f"{', '.join(unseen)}: only a measurement tells" if unseen else ""
        if facts is None:
            rows.append(DryRow(cand.label, None, None, "", None, where, note))
            continue
        try:
            measured = measured_from_profile(profile, facts)
            fc = forecast(job, plan, measured, kv_tokens=None, servers=None, budget_s=None,
                          mode="proportional", priority=())
        except (MemoryModelError, JobError) as e:
            rows.append(DryRow(cand.label, None, None, "", None, where, str(e)))
            continue
        p = fc.prediction
        rows.append(DryRow(cand.label, measured.kv_tokens, p.steady.running, p.steady.bound,
                           p.duration_s, where, note))
    if reference.speed is None:
        header.append("decode speed: assumed (give the profile a `speed:` section)")
    else:
        header.append(f"decode speed: {reference.speed.source or 'the profile speed points'}")
    return rows, header


def format_dry_run(rows: list[DryRow], header: list[str]) -> str:
    ref = rows[0].duration_s if rows else None
    lines = [*(f"# {h}" for h in header),
             f"{'candidate':<44} {'KV tokens':>11} {'running':>12} {'job':>9} {'vs ref':>7}"
             "  measure on"]
    for r in rows:
        kv = f"{r.kv_tokens:,}" if r.kv_tokens is not None else "?"
        running = f"{r.running:.0f} ({r.bound})" if r.running is not None else "?"
        job = format_duration(r.duration_s) if r.duration_s is not None else "?"
        ratio = (f"{r.duration_s / ref:.2f}x" if r.duration_s is not None and ref else "?")
        lines.append(f"{r.label:<44} {kv:>11} {running:>12} {job:>9} {ratio:>7}  {r.where}"
                     + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines)

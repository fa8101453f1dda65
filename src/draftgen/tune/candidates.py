"""Which server configurations a tune tries: the grid per engine, from a profile and a job.

A candidate is the reference profile with a few levers changed (`Levers`). The default grid
changes one lever at a time, a value or two per lever, in the order the levers usually pay
(KV memory, the running-request limit, speculative decoding, DP attention, prefill chunk,
HiCache) so a budget that runs out has measured the likely winners:

    lever                 default values (r: the reference's setting)
    mem_fraction          r + 0.02, r + 0.04 (at most 0.95; GPU engines)
    cpu_kv_gib            2 × r, where the host has the RAM (an engine's CPU build)
    max_running_requests  the job's concurrency when r is below it, else 2 × r
    speculative           on, where the profile's tune section names a draft
    dcp                   tp, for an MLA model with tp >= 2 (engines and releases that have
                          it); replaces DP attention where the reference has it on
    speculative_adaptive  on, with a draft, where the release has it (measured at the job's
                          own concurrency, like every candidate)
    dp_attention          on, for an MLA model with tp >= 2 (engines and releases that have it)
    chunked_prefill       2 × r (r unset: 8192 on GPUs, 2048 on a CPU build)
    hicache_gb_per_rank   off when on; else the largest size up to 64 GB the host RAM allows
    kv_cache_dtype        the engine's fp8 — only where the profile's quality override allows
                          a lossy cache

Prefix caching and the compute dtype are tried when the profile's `tune:` section lists
them; a lever listed there replaces its default values, `[]` drops it, and
`tune.candidates` replaces the grid. After the first round, `combined` takes the best value
of every lever that beat the reference and tries them together.

A candidate that cannot pay is skipped (`not_binding`): any that changes nothing the
reference does not already run with, and a default one whose lever did not bind — more KV
memory when the reference's cache peaked below KV_BINDS with no preemption and the capacity
model's projection of the whole job stays below it too, a higher running limit when the
reference never ran as many as its own. Values the profile's `tune:` section asks for are
measured unless they change nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.engines.install import EngineInstall
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.servers.preflight import GB, HICACHE_RESERVE_BYTES, gpu_ranks
from draftgen.servers.profile import ServerProfile
from draftgen.servers.tune_section import Levers, TuneSpace
from draftgen.tune.directory import Trial
from draftgen.tune.levers import apply_levers, flag_value, prefix_cache_on, speculative_on
from draftgen.tune.predict import KvDemand

REFERENCE = "reference"
COMBINED = "combined"
MAX_MEM_FRACTION = 0.95
HICACHE_DEFAULT_GB = 64
_GIB = 1024**3
# Lever order of the grid: the ones that usually pay first.
LEVER_ORDER = (
    "mem_fraction", "cpu_kv_gib", "dcp", "max_running_requests", "speculative",
    "speculative_adaptive", "dp_attention", "chunked_prefill", "hicache_gb_per_rank",
    "prefix_cache", "model_dtype", "kv_cache_dtype",
)  # fmt: skip
# KV usage under which a cache that saw no preemption did not bind (a request waits for
# blocks well before usage reads 100%).
KV_BINDS = 0.80
# Levers that only add KV capacity (fp8 KV is not among them: it also reads less memory).
_KV_SIZE = ("mem_fraction", "cpu_kv_gib", "hicache_gb_per_rank")


@dataclass(frozen=True)
class Candidate:
    id: str
    levers: Levers
    origin: str = "grid"  # reference, grid, listed (tune.candidates), combined

    @property
    def is_reference(self) -> bool:
        return self.id == REFERENCE

    @property
    def label(self) -> str:
        changes = self.levers.changes()
        if not changes:
            return REFERENCE
        return ", ".join(f"{k}={_show(v)}" for k, v in changes.items())


def _show(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def candidate_for(levers: Levers, origin: str = "grid") -> Candidate:
    changes = levers.changes()
    if not changes:
        return Candidate(REFERENCE, levers, REFERENCE)
    text = json.dumps(changes, sort_keys=True, separators=(",", ":"))
    return Candidate(hashlib.sha256(text.encode()).hexdigest()[:8], levers, origin)


@dataclass(frozen=True)
class HostFacts:
    """What the grid needs to know of the machine and the installed engine."""

    available_bytes: int | None = None
    install: EngineInstall | None = None
    # Whether the model uses multi-head latent attention (DeepSeek-V3, Kimi-K2); None: unknown.
    mla: bool | None = None


def is_mla_model(model_path: str) -> bool | None:
    """From the checkpoint's config.json (`kv_lora_rank`), where the folder (or the file
    itself) is readable."""
    given = Path(model_path)
    path = given if given.suffix == ".json" else given / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    inner = text if isinstance(text, dict) else {}
    return "kv_lora_rank" in config or "kv_lora_rank" in inner


def config_path(profile: ServerProfile) -> str:
    """Where the model's config.json is read: the profile's memory.model_config, else the
    checkpoint's folder."""
    memory = profile.memory
    return memory.model_config_path if memory and memory.model_config_path \
        else profile.model_path


def is_cpu_build(profile: ServerProfile) -> bool:
    env = engine_for(profile.engine).cpu_kv_env
    return env is not None and env in profile.env


def default_values(profile: ServerProfile, job_concurrency: int,
                   host: HostFacts) -> dict[str, list[Any]]:
    """The default grid's values per lever (see the module docstring)."""
    engine = engine_for(profile.engine)
    values: dict[str, list[Any]] = {}
    if not is_cpu_build(profile):
        base = profile.mem_fraction or engine.default_mem_fraction
        values["mem_fraction"] = [v for v in (round(base + 0.02, 2), round(base + 0.04, 2))
                                  if base < v <= MAX_MEM_FRACTION]
    else:
        gib = _int(profile.env.get(engine.cpu_kv_env or "")) or 4
        room = host.available_bytes
        values["cpu_kv_gib"] = [2 * gib] if room is None or 2 * gib * _GIB < room // 2 else []
    limit = profile.max_running_requests
    if limit is not None:
        values["max_running_requests"] = [job_concurrency if limit < job_concurrency
                                          else 2 * limit]
    spec = profile.tune.speculative if profile.tune else None
    values["speculative"] = [True] if spec is not None and not speculative_on(profile) else []
    known = host.install.flags if host.install is not None else None
    if "dp_attention" in engine.features and not profile.dp_attention and profile.tp >= 2 \
            and host.mla:
        has = known is None or bool(engine.dp_attention_flags & known)
        values["dp_attention"] = [True] if has else []
    if "dcp" in engine.features and profile.dcp == 1 and profile.tp >= 2 and host.mla:
        # The whole TP group: an MLA latent is one head that plain TP copies onto every GPU.
        has = known is None or bool(engine.dcp_flags & known)
        values["dcp"] = [profile.tp] if has else []
    flag = engine.speculative_adaptive_flag
    if flag is not None and (spec is not None or speculative_on(profile)) \
            and flag not in profile.extra_args \
            and engine.speculative_adaptive_problem(profile) is None:
        values["speculative_adaptive"] = [True] if known is not None and flag in known else []
    chunk = _int(flag_value(profile.extra_args, engine.chunk_flag))
    values["chunked_prefill"] = [2 * (chunk or (2048 if is_cpu_build(profile) else 8192))]
    if "hierarchical_cache" in engine.features:
        values["hicache_gb_per_rank"] = _hicache_values(profile, host.available_bytes)
    if profile.quality.allow_lossy_kv_cache:
        values["kv_cache_dtype"] = [engine.lossy_kv_default]
    return values


def _hicache_values(profile: ServerProfile, available: int | None) -> list[int]:
    if profile.hierarchical_cache.enabled:
        return [0]
    if available is None:
        return []
    largest = (available - HICACHE_RESERVE_BYTES) // gpu_ranks(profile) // GB
    return [int(min(HICACHE_DEFAULT_GB, largest))] if largest >= 1 else []


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _current(profile: ServerProfile, lever: str) -> Any:
    """The reference's own value of a lever, where it is a plain field."""
    engine = engine_for(profile.engine)
    return {
        "mem_fraction": profile.mem_fraction,
        "max_running_requests": profile.max_running_requests,
        "kv_cache_dtype": profile.kv_cache_dtype,
        "model_dtype": profile.model_dtype,
        "model_path": profile.model_path,
        "dp_attention": profile.dp_attention,
        "dcp": profile.dcp,
        "speculative_adaptive": (engine.speculative_adaptive_flag or "") in profile.extra_args,
        "cpu_kv_gib": _int(profile.env.get(engine.cpu_kv_env or "")),
        "chunked_prefill": _int(flag_value(profile.extra_args, engine.chunk_flag)),
        "hicache_gb_per_rank": (profile.hierarchical_cache.host_gb_per_rank
                                if profile.hierarchical_cache.enabled else 0),
        "speculative": speculative_on(profile),
    }.get(lever)


def build_grid(profile: ServerProfile, job_concurrency: int, host: HostFacts) -> list[Candidate]:
    """The reference first, then one candidate per lever value (or the listed candidates)."""
    space = profile.tune or TuneSpace()
    out = [candidate_for(Levers())]
    if space.candidates is not None:
        listed = [candidate_for(lv, "listed") for lv in space.candidates]
        return _unique(out + listed)
    defaults = default_values(profile, job_concurrency, host)
    for lever in LEVER_ORDER:
        # `tune.speculative` names the draft; the lever's values are the default's ([true]).
        chosen = None if lever == "speculative" else getattr(space, lever)
        for value in defaults.get(lever, []) if chosen is None else chosen:
            if value == _current(profile, lever):
                continue
            out.append(candidate_for(Levers.model_validate({lever: value})))
    return _unique(out)


def _unique(cands: Sequence[Candidate]) -> list[Candidate]:
    seen: set[str] = set()
    out = []
    for c in cands:
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return out


def combine(candidates: Sequence[Candidate], better: Callable[[Candidate], float | None]
            ) -> Candidate | None:
    """The best value of every lever whose single-lever candidate beat the reference, together.

    `better(c)` is c's gain over the reference (predicted duration ratio below 1, say 0.9),
    or None where c failed, lost, or was not measured. None when fewer than two levers helped.
    """
    best: dict[str, tuple[float, Any]] = {}
    for c in candidates:
        changes = c.levers.changes()
        if len(changes) != 1 or c.is_reference:
            continue
        ratio = better(c)
        (lever, value), = changes.items()
        if ratio is not None and (lever not in best or ratio < best[lever][0]):
            best[lever] = (ratio, value)
    if len(best) < 2:
        return None
    merged = Levers.model_validate({k: v for k, (_, v) in best.items()})
    return candidate_for(merged, COMBINED)


def not_binding(reference: ServerProfile,
                demand: Callable[[Trial], KvDemand | None] | None = None,
                ) -> Callable[[Candidate, Trial], str | None]:
    """Why a candidate cannot pay, from the reference's first trial; None: measure it.

    Any candidate (listed and combined ones too) that changes nothing the reference does
    not already run with: each lever at the reference's effective value — the same
    command line and environment, the prefix cache or speculative decoding already as
    asked, the running limit its server reported. It could only win on noise.

    A default candidate whose lever did not bind (values the `tune:` section lists are
    measured): more KV memory where the reference's window saw its cache peak below
    KV_BINDS with no preemption *and* `demand(ref)`, the capacity model's projection of
    the whole job on the reference, stays below KV_BINDS of its KV tokens with no
    preemption in the simulation — a window is too short to see long answers fill a cache,
    so without a projection more KV is always measured; a higher running limit where the
    reference never ran as many as its own.
    """
    space = reference.tune or TuneSpace()
    engine = engine_for(reference.engine)
    launched = (engine.argv(reference, port=0), dict(reference.env))

    def unchanged(lever: str, value: Any, ref: Trial) -> bool:
        if lever == "max_running_requests":
            own = reference.max_running_requests or ref.max_running
            return own is not None and value == own
        try:
            applied = apply_levers(reference, Levers.model_validate({lever: value}))
        except (JobError, ValueError):
            return False  # not ours to refuse: the measurement says why
        if lever == "prefix_cache":
            return prefix_cache_on(applied) == prefix_cache_on(reference)
        if lever == "speculative":
            return speculative_on(applied) == speculative_on(reference)
        return (engine.argv(applied, port=0), dict(applied.env)) == launched

    def why(cand: Candidate, ref: Trial) -> str | None:
        changes = cand.levers.changes()
        if changes and all(unchanged(k, v, ref) for k, v in changes.items()):
            return (f"not tried: it changes nothing ({cand.label} is what the reference "
                    "already runs with)")
        if cand.origin != "grid" or len(changes) != 1 or ref.load is None:
            return None
        (lever, value), = changes.items()
        if getattr(space, lever, None) is not None:
            return None  # asked for by the profile
        kv, preempted = ref.load.get("kv_peak"), ref.load.get("preempted")
        if lever in _KV_SIZE and (lever != "hicache_gb_per_rank" or value) \
                and kv is not None and kv < KV_BINDS and not preempted:
            job = demand(ref) if demand is not None else None
            if job is None or not ref.kv_tokens or job.preemptions \
                    or job.tokens >= KV_BINDS * ref.kv_tokens:
                return None  # the whole job may fill what a short window left empty
            return (f"not tried: the reference's KV cache peaked at {kv:.0%} with no "
                    f"preemption, and the job's projected demand ({job.running:.0f} running "
                    f"× {job.footprint:,.0f} tokens = {job.tokens:,.0f}) is "
                    f"{job.tokens / ref.kv_tokens:.0%} of its {ref.kv_tokens:,} KV tokens, "
                    "so more KV cannot pay")
        running, limit = ref.load.get("running_peak"), reference.max_running_requests
        if lever == "max_running_requests" and limit is not None and isinstance(value, int) \
                and value > limit and running is not None and running < limit:
            return (f"not tried: the reference ran at most {running} requests at once, "
                    f"below its limit of {limit}")
        return None

    return why

"""A candidate's levers applied to the reference profile: the profile it launches with.

Levers that are profile fields change the field (memory fraction, running limit, KV and
compute dtype, HiCache, DP attention). The others are engine flags the profile carries in
`extra_args`, where a candidate replaces whatever the reference set; each engine spells
them in its own `levers.py` (`engines/<engine>/`): the prefill chunk, the prefix
cache, speculative decoding, and a CPU build's KV size (an environment variable).

The result is validated again as a profile, so a lever that makes no sense for the engine
is refused with the profile's own message.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from draftgen.engines.base import Engine
from draftgen.engines.common import drop_flag, flag_value, set_flag
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.servers.profile import HierarchicalCache, ServerProfile
from draftgen.servers.tune_section import Levers

__all__ = ["apply_levers", "drop_flag", "flag_value", "prefix_cache_on", "set_flag",
           "speculative_on"]


def prefix_cache_on(profile: ServerProfile) -> bool:
    """Whether the profile runs with a prefix cache (both engines default to one)."""
    return engine_for(profile.engine).prefix_cache_on(profile.extra_args)


def speculative_on(profile: ServerProfile) -> bool:
    engine = engine_for(profile.engine)
    return any(flag_value(profile.extra_args, f) is not None for f in engine.speculative_flags)


def _without_speculative(engine: Engine, args: Sequence[str]) -> list[str]:
    out = list(args)
    for f in engine.speculative_flags:
        out = drop_flag(out, f, valued=True)
    return out


def apply_levers(profile: ServerProfile, levers: Levers) -> ServerProfile:
    """The reference profile with `levers` applied; JobError if that is no valid profile."""
    engine = engine_for(profile.engine)
    data = profile.model_dump(mode="json", by_alias=False)
    args = list(profile.extra_args)
    env = dict(profile.env)
    for name in ("mem_fraction", "max_running_requests", "kv_cache_dtype", "model_dtype"):
        value = getattr(levers, name)
        if value is not None:
            data[name] = value
    if levers.model_path is not None:
        folder = profile.source_file.parent if profile.source_file else None
        local = Path(levers.model_path).expanduser()
        data["model_path"] = (str(folder / local) if folder and not local.is_absolute()
                              and (folder / local).exists() else levers.model_path)
    if levers.hicache_gb_per_rank is not None:
        size = levers.hicache_gb_per_rank
        data["hierarchical_cache"] = (HierarchicalCache(enabled=True, host_gb_per_rank=size)
                                      if size else HierarchicalCache()).model_dump()
    if levers.dp_attention is not None:
        data["dp_attention"] = levers.dp_attention
        # Attention DP splits the TP group; without it the profile keeps one replica.
        data["dp"] = (profile.dp if profile.dp > 1 else profile.tp) if levers.dp_attention else 1
    if levers.dcp is not None:
        data["dcp"] = levers.dcp
        if levers.dp_attention is None and profile.dp_attention and levers.dcp > 1:
            # Two ways to split attention state over the TP group: DCP replaces DP attention.
            data["dp_attention"], data["dp"] = False, 1
    if levers.prefix_cache is False and data["hierarchical_cache"]["enabled"]:
        # HiCache is a tier of the prefix (radix) cache: no engine takes one without the other.
        if levers.hicache_gb_per_rank:
            raise JobError("prefix_cache: false and hicache_gb_per_rank exclude each other "
                           "(the hierarchical cache extends the prefix cache)")
        data["hierarchical_cache"] = HierarchicalCache().model_dump()
    if levers.chunked_prefill is not None:
        args = set_flag(args, engine.chunk_flag, str(levers.chunked_prefill))
    if levers.prefix_cache is not None:
        args = engine.with_prefix_cache(args, levers.prefix_cache)
    if levers.speculative_adaptive is not None:
        flag = engine.speculative_adaptive_flag
        problem = engine.speculative_adaptive_problem(profile)
        if flag is None or (levers.speculative_adaptive and problem is not None):
            raise JobError(f"speculative_adaptive: {problem}")
        args = drop_flag(args, flag, valued=False)
        if levers.speculative_adaptive:
            if levers.speculative is False or (levers.speculative is None
                                               and not speculative_on(profile)
                                               and not (profile.tune and
                                                        profile.tune.speculative)):
                raise JobError("speculative_adaptive: needs speculative decoding on")
            args.append(flag)
            if levers.speculative is None and not speculative_on(profile):
                levers = levers.model_copy(update={"speculative": True})
    if levers.speculative is not None:
        args = _without_speculative(engine, args)
        if levers.speculative:
            spec = profile.tune.speculative if profile.tune else None
            if spec is None:
                raise JobError("speculative: the profile's tune section names no draft "
                               "(tune: {speculative: {method: ..., draft_model: ...}})")
            args += engine.speculative_args(spec)
    if levers.cpu_kv_gib is not None:
        if engine.cpu_kv_env is None:
            raise JobError(f"cpu_kv_gib: {engine.display_name} has no CPU build KV size")
        env[engine.cpu_kv_env] = str(levers.cpu_kv_gib)
    data["extra_args"], data["env"] = args, env
    try:
        candidate = ServerProfile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "profile"
        raise JobError(f"{where}: {first['msg']}") from None
    candidate._source_file = profile.source_file
    return candidate

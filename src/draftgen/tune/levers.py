"""A candidate's levers applied to the reference profile: the profile it launches with.

Levers that are profile fields change the field (memory fraction, running limit, KV and
compute dtype, HiCache, DP attention). The others are engine flags the profile carries in
`extra_args`, where a candidate replaces whatever the reference set:

    lever             SGLang                                 vLLM
    chunked_prefill   --chunked-prefill-size N               --max-num-batched-tokens N
    prefix_cache      (on by default) / --disable-radix-cache --enable-prefix-caching /
                                                               --no-enable-prefix-caching
    speculative       --speculative-algorithm A              --speculative-config JSON
                      --speculative-draft-model-path P ...
    cpu_kv_gib        -                                      env VLLM_CPU_KVCACHE_SPACE

SGLang divides the prefill chunk among DP-attention ranks (the flag is the TP group's).
The result is validated again as a profile, so a lever that makes no sense for the engine
is refused with the profile's own message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from draftgen.errors import JobError
from draftgen.servers.profile import HierarchicalCache, ServerProfile
from draftgen.servers.tuning import Levers, Speculative

CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
CHUNK_FLAG = {"sglang": "--chunked-prefill-size", "vllm": "--max-num-batched-tokens"}
_SGLANG_NO_RADIX = "--disable-radix-cache"
_VLLM_PREFIX_ON, _VLLM_PREFIX_OFF = "--enable-prefix-caching", "--no-enable-prefix-caching"
_SGLANG_SPEC_VALUED = (
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens",
)  # fmt: skip
_VLLM_SPEC_VALUED = ("--speculative-config",)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value `args` give `flag` (`--f V` or `--f=V`; the last one wins), or None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def drop_flag(args: Sequence[str], flag: str, *, valued: bool) -> list[str]:
    """`args` without `flag` (and its value, for a flag that takes one)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = valued
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def set_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    return [*drop_flag(args, flag, valued=True), flag, value]


def prefix_cache_on(profile: ServerProfile) -> bool:
    """Whether the profile runs with a prefix cache (both engines default to one)."""
    args = profile.extra_args
    if profile.engine == "sglang":
        return _SGLANG_NO_RADIX not in args
    on = off = -1
    for i, a in enumerate(args):
        if a == _VLLM_PREFIX_ON:
            on = i
        elif a == _VLLM_PREFIX_OFF:
            off = i
    return off < on or off == -1


def speculative_on(profile: ServerProfile) -> bool:
    flags = _SGLANG_SPEC_VALUED if profile.engine == "sglang" else _VLLM_SPEC_VALUED
    return any(flag_value(profile.extra_args, f) is not None for f in flags)


def speculative_args(engine: str, spec: Speculative) -> list[str]:
    """The engine's flags for the profile's draft."""
    if engine == "sglang":
        args = ["--speculative-algorithm", spec.method]
        if spec.draft_model:
            args += ["--speculative-draft-model-path", spec.draft_model]
        steps = spec.num_steps or max(1, spec.num_tokens - 1)
        args += ["--speculative-num-steps", str(steps),
                 "--speculative-eagle-topk", str(spec.eagle_topk or 1),
                 "--speculative-num-draft-tokens", str(spec.num_tokens)]
        return args
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_tokens}
    if spec.draft_model:
        config["model"] = spec.draft_model
    if spec.method == "ngram":
        # vLLM needs the n-gram window for prompt lookup; these are its documented examples.
        config.update(prompt_lookup_max=4, prompt_lookup_min=2)
    return ["--speculative-config", json.dumps(config, separators=(",", ":"))]


def _without_speculative(engine: str, args: Sequence[str]) -> list[str]:
    out = list(args)
    for f in _SGLANG_SPEC_VALUED if engine == "sglang" else _VLLM_SPEC_VALUED:
        out = drop_flag(out, f, valued=True)
    return out


def apply_levers(profile: ServerProfile, levers: Levers) -> ServerProfile:
    """The reference profile with `levers` applied; JobError if that is no valid profile."""
    engine = profile.engine
    data = profile.model_dump(mode="json", by_alias=False)
    args = list(profile.extra_args)
    env = dict(profile.env)
    for name in ("mem_fraction", "max_running_requests", "kv_cache_dtype", "model_dtype"):
        value = getattr(levers, name)
        if value is not None:
            data[name] = value
    if levers.hicache_gb_per_rank is not None:
        size = levers.hicache_gb_per_rank
        data["hierarchical_cache"] = (HierarchicalCache(enabled=True, host_gb_per_rank=size)
                                      if size else HierarchicalCache()).model_dump()
    if levers.dp_attention is not None:
        data["dp_attention"] = levers.dp_attention
        # Attention DP splits the TP group; without it the profile keeps one replica.
        data["dp"] = (profile.dp if profile.dp > 1 else profile.tp) if levers.dp_attention else 1
    if engine == "sglang" and levers.prefix_cache is False \
            and data["hierarchical_cache"]["enabled"]:
        # HiCache is a tier of the radix cache: SGLang refuses the one without the other.
        if levers.hicache_gb_per_rank:
            raise JobError("prefix_cache: false and hicache_gb_per_rank exclude each other "
                           "(SGLang's HiCache extends the radix cache)")
        data["hierarchical_cache"] = HierarchicalCache().model_dump()
    if levers.chunked_prefill is not None:
        args = set_flag(args, CHUNK_FLAG[engine], str(levers.chunked_prefill))
    if levers.prefix_cache is not None:
        args = _with_prefix_cache(engine, args, levers.prefix_cache)
    if levers.speculative is not None:
        args = _without_speculative(engine, args)
        if levers.speculative:
            spec = profile.tune.speculative if profile.tune else None
            if spec is None:
                raise JobError("speculative: the profile's tune section names no draft "
                               "(tune: {speculative: {method: ..., draft_model: ...}})")
            args += speculative_args(engine, spec)
    if levers.cpu_kv_gib is not None:
        env[CPU_KV_ENV] = str(levers.cpu_kv_gib)
    data["extra_args"], data["env"] = args, env
    try:
        candidate = ServerProfile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "profile"
        raise JobError(f"{where}: {first['msg']}") from None
    candidate._source_file = profile.source_file
    return candidate


def _with_prefix_cache(engine: str, args: list[str], on: bool) -> list[str]:
    if engine == "sglang":
        args = drop_flag(args, _SGLANG_NO_RADIX, valued=False)
        return args if on else [*args, _SGLANG_NO_RADIX]
    args = drop_flag(drop_flag(args, _VLLM_PREFIX_ON, valued=False), _VLLM_PREFIX_OFF,
                     valued=False)
    return [*args, _VLLM_PREFIX_ON if on else _VLLM_PREFIX_OFF]

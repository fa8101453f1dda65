"""A stand-in for an SGLang server, which cannot run on CPU: it answers as SGLang 0.5.23 or
0.5.9 does, as strictly as their own code (read from the releases; see
.cache/oracle-research/FINDINGS.md and tests/conformance/ for the checks against it).

Versions: `StandinConfig.version` (default 0.5.9, what the in-process tests were written
against); a launched process reads `STANDIN_VERSION` (default 0.5.23, the newest). Any other
version string answers in the shape of the nearest of the two (0.4.x and 0.5.x below 0.5.23
like 0.5.9), for the older-release tests; argv parsing knows only the two.

- Launch argv: `argparse.parse_args` over the flags draftgen emits, with each release's
  option strings, aliases, choices and types. An unknown flag exits 2 with argparse's
  "unrecognized arguments" (0.5.9 has no `--attn-dp-size`); a layout the release refuses
  exits 1 with its error. 0.5.23 resolves `--dp-size N --enable-dp-attention` to dp_size 1,
  attn_dp_size N (with its deprecation warning), refuses `--dp-size N --attn-dp-size M`.
- `python -c PROBE PATH DIST...` (draftgen.engines.install.detect_install): answers as a
  Python with that SGLang installed, `{"version", "flags", "dist"}`, the flags being this
  parser's option strings.
- `GET /health`, `/health_generate`: 503 while starting (the first `starting_polls`
  requests to any generating endpoint), then 200.
- `GET /server_info` and the deprecated `/get_server_info` (with `old_api` only that one):
  the resolved server arguments, the scheduler info, one `internal_states` entry per DP
  rank with the release's `memory_usage`, and `version`.
- `GET /v1/loads` (absent with `old_api`): the release's body, ranks listed in reverse
  (clients must order by dp_rank); 0.5.23 shows ranks >= 1 as all-zero slots for the first
  `unpublished_polls` answers, as before their schedulers first publish.
- `GET /metrics` with `--enable-metrics`: the release's family names and label sets, one
  scheduler sample per DP rank, values following the in-flight requests.
- `POST /v1/chat/completions`: the body validated like SGLang's pydantic model (unknown
  fields dropped, a wrong type is HTTP 400); `stream: true` streams SGLang's chunk
  sequence (role, reasoning/content deltas, finish, 0.5.23's sglext ids chunk, usage,
  `[DONE]`). Token ids are deterministic (`prompt_token_ids`, `output_token_ids`); the
  request's `seed` changes them only with `--enable-deterministic-inference`.
- `GET /v1/models`.

Capacity follows the arguments like the real thing in direction: proportional to
`--mem-fraction-static`, doubled by an fp8/fp4 KV cache. It runs in-process
(`start_standin`) or as a process launched with SGLang's own argv (`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ValidationError, model_validator

TOKENS_PER_MEM_FRACTION = 200_000
NEWEST = "0.5.23"
OLDER = "0.5.9"
VERSIONS = (NEWEST, OLDER)
# The H100 defaults both releases resolve to when the flag is not given (FINDINGS §1).
H100_MEM_FRACTION = 0.818
H100_CHUNKED_PREFILL = 8192
ACCELERATOR = "NVIDIA H100 80GB HBM3"
EOS_TOKEN_ID = 163586
OUTPUT_ID_BASE = 1000
OUTPUT_ID_SPAN = 50_000

KV_CACHE_DTYPES = {
    NEWEST: ["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4",
             "fp4_mx_block16"],
    OLDER: ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"],
}
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
REASONING_PARSERS = {
    NEWEST: ["auto", "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4",
             "deepseek-v41", "dots", "glm45", "ling3", "hunyuan", "gpt-oss", "k2_horizon",
             "kimi", "kimi_k2", "kimi_k3", "mimo", "muse", "poolside_v1", "qwen3",
             "qwen3-thinking", "minimax", "minimax-append-think", "minimax-m3", "nanbeige",
             "step3", "step3p5", "mistral", "nemotron_3", "granite_thinking_parser",
             "interns1", "gemma4", "inkling", "iquest_q1", "cohere_command4", "gigachat35",
             "response_template"],
    OLDER: ["deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi", "kimi_k2", "qwen3",
            "qwen3-thinking", "minimax", "minimax-append-think", "step3", "step3p5",
            "nano_v3", "interns1"],
}
TOOL_CALL_PARSERS = {
    NEWEST: ["auto", "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31",
             "deepseekv32", "deepseekv4", "deepseekv41", "dots", "glm", "glm45", "glm47",
             "gpt-oss", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo",
             "minicpm5", "mistral", "muse", "poolside_v1", "pythonic", "qwen", "qwen25",
             "qwen3_coder", "spark25", "step3", "step3p5", "minimax-m2", "minimax-m3",
             "nanbeige", "trinity", "interns1", "hermes", "hunyuan", "gigachat3",
             "gigachat35", "gemma4", "inkling", "iquest_q1", "response_template"],
    OLDER: ["deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "glm47", "gpt-oss",
            "kimi_k2", "lfm2", "llama3", "mimo", "mistral", "pythonic", "qwen", "qwen25",
            "qwen3_coder", "step3", "step3p5", "minimax-m2", "trinity", "interns1", "hermes",
            "gigachat3"],
}
# The argparse prog each release's prepare_server_args builds its parser with.
PROG = {NEWEST: "sglang serve", OLDER: "launch_server.py"}
# Prefixes argparse's allow_abbrev expands on the real parsers (unique there: `--tp` is only
# `--tp-size`, `--dp` only `--dp-size`). This parser has far fewer options, so it expands
# these and no others: an abbreviation that is ambiguous on the real parser is refused.
ABBREVIATIONS = {"--tp": "--tp-size", "--dp": "--dp-size"}
DEPRECATED_DP_ATTENTION = (
    "'--enable-dp-attention' is deprecated and will be removed in a future release. "
    "Use '--attn-dp-size <dp-size>' instead."
)
# 0.5.23 serving_chat.py `_convert_to_internal_request`, checked in this order.
STREAM_REFUSED = (
    ("return_prompt_token_ids",
     "return_prompt_token_ids is not supported with streaming. "
     "Please set stream=false when using return_prompt_token_ids=true."),
    ("return_token_ids",
     "return_token_ids is not supported with streaming on /v1/chat/completions. "
     "Please set stream=false when using return_token_ids=true."),
    ("return_meta_info",
     "return_meta_info is not supported with streaming. "
     "Please set stream=false when using return_meta_info=true."),
)
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def version_shape(version: str) -> str:
    """The release whose shapes `version` answers in: 0.5.23 and later, or 0.5.9."""
    numbers = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return NEWEST if numbers >= (0, 5, 23) else OLDER


def known_version(version: str) -> str:
    if version not in VERSIONS:
        raise ValueError(f"the stand-in knows SGLang {' and '.join(VERSIONS)}, not {version!r}")
    return version


@dataclass
class StandinConfig:
    # Server arguments, as given (raw, before the release resolves them).
    model_path: str = "/models/Kimi-K2.5"
    served_model_name: str | None = "kimi-k2.5"
    tp_size: int = 8
    dp_size: int = 1
    enable_dp_attention: bool = False
    # 0.5.23 only (`--attn-dp-size`); 0.5.9 has no such argument and refuses anything but 1.
    attn_dp_size: int = 1
    enable_deterministic_inference: bool = False
    mem_fraction_static: float = 0.88
    kv_cache_dtype: str = "bf16"
    dtype: str = "auto"
    enable_hierarchical_cache: bool = False
    hicache_size: int = 0
    max_running_requests: int | None = None
    context_length: int | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    enable_metrics: bool = False
    # 0.5.23's server-wide `--return-output-ids`: every stream gets the sglext ids chunk.
    return_output_ids: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    version: str = OLDER
    # --- behaviour of the stand-in itself ---
    # Requests to generating endpoints answered 503 before the server is "up".
    starting_polls: int = 0
    # Only /get_server_info, no /v1/loads: an SGLang before 0.5.8.
    old_api: bool = False
    # Older releases report no token_capacity in internal_states' memory_usage.
    states_have_capacity: bool = True
    # Rank i gets capacity - i * jitter, to tell per-rank sources apart.
    rank_jitter: int = 0
    # 0.5.23: this many first /v1/loads answers show every rank >= 1 as an all-zero slot.
    unpublished_polls: int = 0
    # The answer the "model" wants to write (content tokens), before max_tokens cuts it.
    answer_tokens: int = 8
    # Reasoning tokens written first; streamed as `reasoning_content` when the server has a
    # --reasoning-parser and the request keeps `separate_reasoning`, else as content.
    # A request with chat_template_kwargs {"enable_thinking": false} (or "thinking") gets none.
    reasoning_tokens: int = 0
    # After this many delta chunks a stream fails as on an internal error: 0.5.23 sends its
    # error object, 0.5.9 finishes with finish_reason "abort".
    error_after_chunks: int | None = None
    # The first N requests are retracted once, halfway (back to the waiting queue).
    retract_requests: int = 0
    # Seconds between generated tokens, so that in-flight requests can be observed.
    token_delay_s: float = 0.0
    # Paths of the requests received, in order.
    seen: list[str] = field(default_factory=list)

    @property
    def shape(self) -> str:
        return version_shape(self.version)

    def rank_capacity(self, rank: int) -> int:
        per_rank = int(self.mem_fraction_static * TOKENS_PER_MEM_FRACTION)
        if self.kv_cache_dtype.startswith(("fp8", "fp4", "mxfp8", "nvfp4")):
            per_rank *= 2
        return per_rank - rank * self.rank_jitter

    def rank_max_running(self) -> int:
        total = self.max_running_requests or 2048
        return total // resolve_layout(self).ranks


@dataclass(frozen=True)
class Layout:
    """The data-parallel layout a release resolves the arguments to."""

    dp_size: int
    attn_dp_size: int | None  # None: the release has no such argument (0.5.9)
    enable_dp_attention: bool

    @property
    def ranks(self) -> int:
        """DP schedulers, each with its own KV pool: one /v1/loads and state entry each."""
        return self.dp_size * (self.attn_dp_size or 1)

    @property
    def attention_width(self) -> int:
        """Attention DP groups inside the TP group (1 without DP attention)."""
        if not self.enable_dp_attention:
            return 1
        return self.attn_dp_size if self.attn_dp_size is not None else self.dp_size


def resolve_layout(cfg: StandinConfig) -> Layout:
    """0.5.23's arg_groups/parallel_hook.py, or 0.5.9's ServerArgs._handle_data_parallelism;
    raises what they raise for a layout they refuse."""
    if cfg.shape == NEWEST:
        dp, attn = cfg.dp_size, cfg.attn_dp_size
        if cfg.enable_dp_attention and attn == 1:
            dp, attn = 1, cfg.dp_size  # handle_deprecated_dp_attention
        if attn < 1:
            raise ValueError(f"--attn-dp-size must be positive (got {attn}).")
        if attn > 1 and dp > 1:
            raise ValueError(
                f"--dp-size {dp} with --attn-dp-size {attn}: data-parallel replicas combined "
                "with attention data parallelism are not supported."
            )
        if attn > 1 and cfg.tp_size % attn:
            raise AssertionError()
        return Layout(dp_size=dp, attn_dp_size=attn, enable_dp_attention=attn > 1)
    if cfg.attn_dp_size != 1:
        raise ValueError(f"SGLang {cfg.version} has no --attn-dp-size")
    attention = cfg.enable_dp_attention and cfg.dp_size > 1
    if attention and cfg.tp_size % cfg.dp_size:
        raise AssertionError()
    return Layout(dp_size=cfg.dp_size, attn_dp_size=None, enable_dp_attention=attention)


def validate_config(cfg: StandinConfig) -> Layout:
    """What the release refuses at start: a choice outside its lists, a refused layout."""
    for name, choices in (("kv_cache_dtype", KV_CACHE_DTYPES), ("reasoning_parser",
                          REASONING_PARSERS), ("tool_call_parser", TOOL_CALL_PARSERS)):
        value = getattr(cfg, name)
        if value is not None and value not in choices[cfg.shape]:
            raise ValueError(f"SGLang {cfg.version}: invalid {name} {value!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"invalid dtype {cfg.dtype!r}")
    if cfg.return_output_ids and cfg.shape != NEWEST:
        raise ValueError(f"SGLang {cfg.version} has no --return-output-ids")
    return resolve_layout(cfg)


# --------------------------------------------------------------------------- argv


def human_readable_int(value: str) -> int:
    """0.5.23's `--context-length` type (utils/common.py): 1k, 25.6k, 1Ki, plain ints."""
    value = value.strip()
    si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match:
        number, suffix = match.groups()
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'.")
            return int(number) * iec[suffix]
        return int(Decimal(number) * si[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. Use a plain integer, SI suffixes (1k, 1M), "
            "or IEC suffixes (1Ki, 1Mi). Suffixes are case-sensitive."
        ) from None


class _DeprecatedStoreTrue(argparse.Action):
    """0.5.23's DeprecatedStoreTrueAction: stores True and warns."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, const=True, default=False, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(DEPRECATED_DP_ATTENTION, file=sys.stderr, flush=True)
        setattr(namespace, self.dest, True)


def build_parser(version: str) -> argparse.ArgumentParser:
    """The release's launch parser, restricted to the flags draftgen and the tests use:
    the same option strings (aliases in the release's order), types, choices, defaults."""
    v = known_version(version)
    new = v == NEWEST
    p = argparse.ArgumentParser(prog=PROG[v], allow_abbrev=False)
    p.add_argument("--model-path", "--model", dest="model_path", type=str, required=True)
    p.add_argument("--served-model-name", type=str)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--context-length", type=human_readable_int if new else int)
    p.add_argument("--dtype", type=str, default="auto", choices=DTYPES)
    p.add_argument("--kv-cache-dtype", type=str, default="auto", choices=KV_CACHE_DTYPES[v])
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--page-size", type=int)
    tp = ("--tp-size", "--tensor-parallel-size")
    dp = ("--dp-size", "--data-parallel-size")
    p.add_argument(*(tp if new else tp[::-1]), dest="tp_size", type=int, default=1)
    p.add_argument(*(dp if new else dp[::-1]), dest="dp_size", type=int, default=1)
    if new:
        p.add_argument("--attn-dp-size", "--attention-data-parallel-size", dest="attn_dp_size",
                       type=int, default=1)
        p.add_argument("--enable-dp-attention", action=_DeprecatedStoreTrue)
    else:
        p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--device", type=str)
    p.add_argument("--random-seed", type=int)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    if new:
        p.add_argument("--return-output-ids", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    hicache = ("--enable-hierarchical-cache", "--enable-hicache") if new else (
        "--enable-hierarchical-cache",)
    p.add_argument(*hicache, dest="enable_hierarchical_cache", action="store_true")
    p.add_argument("--hicache-ratio", type=float, default=None if new else 2.0)
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--reasoning-parser", type=str, choices=REASONING_PARSERS[v])
    p.add_argument("--tool-call-parser", type=str, choices=TOOL_CALL_PARSERS[v])
    return p


def option_strings(version: str) -> list[str]:
    """Every option string the stand-in's parser for `version` accepts, sorted."""
    parser = build_parser(version)
    return sorted({s for action in parser._actions for s in action.option_strings})


def _expand_abbreviations(flags: list[str]) -> list[str]:
    out = []
    for arg in flags:
        name, eq, value = arg.partition("=")
        out.append(ABBREVIATIONS[name] + eq + value if name in ABBREVIATIONS else arg)
    return out


def launch_flags(argv: list[str]) -> list[str]:
    """The server flags of `python -m sglang.launch_server FLAGS` (argv after `python`)."""
    if argv[:2] == ["-m", "sglang.launch_server"]:
        return argv[2:]
    return argv


def parse_launch_argv(argv: list[str], version: str | None = None) -> StandinConfig:
    """SGLang's launch flags, as `python -m sglang.launch_server` receives them, parsed as
    the release `version` (default: STANDIN_VERSION, else 0.5.23) does: an unknown flag or
    a bad value exits 2 with argparse's message. Resolution errors raise."""
    v = known_version(version or os.environ.get("STANDIN_VERSION", NEWEST))
    args = build_parser(v).parse_args(_expand_abbreviations(launch_flags(argv)))
    cfg = StandinConfig(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention,
        attn_dp_size=getattr(args, "attn_dp_size", 1),
        enable_deterministic_inference=args.enable_deterministic_inference,
        mem_fraction_static=(H100_MEM_FRACTION if args.mem_fraction_static is None
                             else args.mem_fraction_static),
        # A server that ignores what it was asked for: what the after-start check is for.
        kv_cache_dtype=os.environ.get("STANDIN_KV_DTYPE", args.kv_cache_dtype),
        dtype=args.dtype,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_size=args.hicache_size,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        trust_remote_code=args.trust_remote_code,
        enable_metrics=args.enable_metrics,
        return_output_ids=getattr(args, "return_output_ids", False),
        host=args.host,
        port=args.port,
        version=v,
        starting_polls=int(os.environ.get("STANDIN_STARTING_POLLS", "0")),
    )
    # Any other stand-in option, e.g. STANDIN_OPTIONS='{"unpublished_polls": 2}'.
    for key, value in json.loads(os.environ.get("STANDIN_OPTIONS", "{}")).items():
        if key not in StandinConfig.__dataclass_fields__:
            raise ValueError(f"STANDIN_OPTIONS: no stand-in option {key!r}")
        setattr(cfg, key, value)
    resolve_layout(cfg)
    return cfg


def probe_answer(version: str, dists: list[str]) -> dict[str, Any]:
    """What draftgen's install probe prints on a Python with SGLang `version` installed:
    the first of `dists` that is installed, and its launch parser's option strings."""
    if "sglang" not in dists:
        return {"version": None, "flags": None, "dist": None}
    return {"version": version, "flags": option_strings(version), "dist": "sglang"}


# --------------------------------------------------------------------------- state


@dataclass
class RankState:
    running: int = 0
    waiting: int = 0
    retracted: int = 0
    used_tokens: int = 0
    # Counter children appear on the first increment, as prometheus_client's do.
    retracted_total: int | None = None
    published: bool = False


@dataclass
class ServerState:
    ranks: list[RankState]
    layout: Layout
    polls: int = 0
    loads_polls: int = 0
    requests: int = 0
    # (counter, is_streaming) -> value; a key appears on the first increment.
    tokenizer_counters: dict[tuple[str, bool], float] = field(default_factory=dict)
    slot_free: asyncio.Condition = field(default_factory=asyncio.Condition)

    def count(self, name: str, streaming: bool, value: float) -> None:
        key = (name, streaming)
        self.tokenizer_counters[key] = self.tokenizer_counters.get(key, 0.0) + value


def new_state(cfg: StandinConfig) -> ServerState:
    layout = validate_config(cfg)
    return ServerState(ranks=[RankState() for _ in range(layout.ranks)], layout=layout)


# --------------------------------------------------------------------------- server_info


def server_args(cfg: StandinConfig, layout: Layout | None = None) -> dict[str, Any]:
    """The resolved server arguments the release reports (a subset of its ~330 / ~550 keys,
    every one of them a real key of that release)."""
    layout = layout or resolve_layout(cfg)
    args: dict[str, Any] = {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "served_model_name": cfg.served_model_name or cfg.model_path,
        "host": cfg.host,
        "port": cfg.port,
        "device": "cuda",
        "trust_remote_code": cfg.trust_remote_code,
        "context_length": cfg.context_length,
        "dtype": cfg.dtype,
        "quantization": None,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "mem_fraction_static": cfg.mem_fraction_static,
        "max_running_requests": cfg.max_running_requests,
        "chunked_prefill_size": H100_CHUNKED_PREFILL // layout.attention_width,
        "page_size": 1,
        "schedule_policy": "fcfs",
        "random_seed": 1234,
        "tp_size": cfg.tp_size,
        "pp_size": 1,
        "dp_size": layout.dp_size,
        "enable_dp_attention": layout.enable_dp_attention,
        "attention_backend": "fa3",
        "speculative_algorithm": None,
        "disable_radix_cache": False,
        "enable_hierarchical_cache": cfg.enable_hierarchical_cache,
        "hicache_ratio": 2.0,
        "hicache_size": cfg.hicache_size,
        "enable_metrics": cfg.enable_metrics,
        "enable_deterministic_inference": cfg.enable_deterministic_inference,
        "reasoning_parser": cfg.reasoning_parser,
        "tool_call_parser": cfg.tool_call_parser,
    }
    if layout.attn_dp_size is not None:
        args["attn_dp_size"] = layout.attn_dp_size
        args["return_output_ids"] = cfg.return_output_ids
    return args


def memory_usage(cfg: StandinConfig, rank: int) -> dict[str, Any]:
    """internal_states[i].memory_usage: 0.5.23's build_memory_usage, or 0.5.9's."""
    usage: dict[str, Any] = {"weight": 61.8, "kvcache": 14.2}
    if cfg.shape == NEWEST:
        usage["startup_available"] = 79.1
    if cfg.states_have_capacity:
        usage["token_capacity"] = cfg.rank_capacity(rank)
    if cfg.shape == NEWEST:
        usage["token_capacity_swa"] = None
        usage["graph"] = {"prefill": 0.0, "decode": 1.1, "target_verify": 0.0,
                          "draft_prefill": 0.0, "draft_decode": 0.0, "draft_extend": 0.0}
    else:
        usage["graph"] = 1.1
    return usage


def server_info(cfg: StandinConfig, layout: Layout | None = None) -> dict[str, Any]:
    layout = layout or resolve_layout(cfg)
    args = server_args(cfg, layout)
    states = []
    for rank in range(layout.ranks):
        state = {**args}
        if cfg.shape == NEWEST:
            state["world_size"] = cfg.tp_size * layout.dp_size
            state["startup_time"] = 12.0
        state["effective_max_running_requests_per_dp"] = cfg.rank_max_running()
        state["last_gen_throughput"] = 0.0
        state["memory_usage"] = memory_usage(cfg, rank)
        states.append(state)
    scheduler = {
        "status": "ready",
        "max_total_num_tokens": cfg.rank_capacity(0),
        "max_req_input_len": (cfg.context_length or 131072) - 1,
    }
    if cfg.shape == NEWEST:
        return {**args, "launch_command": None, **scheduler, "startup_time": 12.0,
                "kv_events": None, "internal_states": states, "version": cfg.version,
                "frontend": "python"}
    return {**args, **scheduler, "internal_states": states, "version": cfg.version}


# --------------------------------------------------------------------------- /v1/loads

_CORE_0523 = ("timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
              "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens",
              "num_active_tokens", "num_prealloc_ready_tokens", "max_total_num_tokens",
              "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
              "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us",
              "decode_moments")


def _rank_core(cfg: StandinConfig, state: ServerState, rank: int) -> dict[str, Any]:
    r = state.ranks[rank]
    capacity = cfg.rank_capacity(rank)
    return {
        "dp_rank": rank,
        "num_running_reqs": r.running,
        "num_waiting_reqs": r.waiting,
        "num_used_tokens": r.used_tokens,
        "max_total_num_tokens": capacity,
        "token_usage": round(r.used_tokens / capacity, 4) if capacity else 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "max_running_requests": cfg.rank_max_running(),
    }


def _rank_sections(cfg: StandinConfig, state: ServerState, rank: int) -> dict[str, Any]:
    r = state.ranks[rank]
    queues: dict[str, int] = {"waiting": r.waiting, "grammar": 0, "paused": 0,
                              "retracted": r.retracted}
    disagg: dict[str, Any] = {"mode": "null"}
    if cfg.shape == NEWEST:
        queues["prealloc_ready"] = 0
        disagg["prefill_bootstrap_queue_reqs"] = 0
    else:
        disagg["prefill_prealloc_queue_reqs"] = 0
    disagg.update({"prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                   "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                   "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0})
    return {
        "memory": {"weight_gb": 61.8, "kv_cache_gb": 14.2, "graph_gb": 1.1,
                   "token_capacity": cfg.rank_capacity(rank)},
        "disaggregation": disagg,
        "queues": queues,
    }


_SECTION_NAMES = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}


def _pick_sections(sections: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    if include is None or "all" in include:
        return sections
    return {k: v for k, v in sections.items() if _SECTION_NAMES[k] in include}


def loads(cfg: StandinConfig, state: ServerState | None = None, *,
          include: set[str] | None = None, dp_rank: int | None = None) -> dict[str, Any]:
    """The /v1/loads body of the release; ranks listed in reverse. Counts one poll."""
    state = state or new_state(cfg)
    state.loads_polls += 1
    if include is not None and not include <= LOAD_SECTIONS:
        raise ValueError(f"Invalid include sections: {include - LOAD_SECTIONS}. "
                         f"Valid options: {sorted(LOAD_SECTIONS)}")
    wanted = [r for r in range(state.layout.ranks) if dp_rank is None or r == dp_rank]
    now = time.time()
    entries = []
    for rank in wanted:
        if cfg.shape == NEWEST:
            published = rank == 0 or state.loads_polls > cfg.unpublished_polls
            if not published:
                # LoadSnapshot(dp_rank=r), the slot's content before its first publish.
                zero: dict[str, Any] = dict.fromkeys(_CORE_0523, 0)
                zero.update(timestamp=0.0, dp_rank=rank, token_usage=0.0, gen_throughput=0.0,
                            cache_hit_rate=0.0, utilization=0.0, decode_moments=None)
                entries.append(zero)
                continue
            core = _rank_core(cfg, state, rank)
            entry = {key: core.get(key, 0) for key in _CORE_0523}
            entry.update(timestamp=now, decode_moments=None)
            if include != {"core"}:
                entry.update(_pick_sections(_rank_sections(cfg, state, rank), include))
            entries.append(entry)
        else:
            entry = _rank_core(cfg, state, rank)
            entry.update(_pick_sections(_rank_sections(cfg, state, rank), include))
            entry["num_total_reqs"] = entry["num_running_reqs"] + entry["num_waiting_reqs"]
            entries.append(entry)
    stamp = datetime.now(UTC).isoformat()
    if cfg.shape == NEWEST:
        per_rank = cfg.tp_size // state.layout.ranks if state.layout.enable_dp_attention \
            else cfg.tp_size
        return {"timestamp": stamp, "version": cfg.version, "accelerator": ACCELERATOR,
                "num_accelerators": per_rank, "loads": entries[::-1]}
    n = len(entries)
    aggregate = {
        "total_running_reqs": sum(e["num_running_reqs"] for e in entries),
        "total_waiting_reqs": sum(e["num_waiting_reqs"] for e in entries),
        "total_reqs": sum(e["num_total_reqs"] for e in entries),
        "avg_token_usage": round(sum(e["token_usage"] for e in entries) / n, 4) if n else 0.0,
        "avg_throughput": 0.0,
        "avg_utilization": 0.0,
    }
    return {"timestamp": stamp, "version": cfg.version, "dp_rank_count": n,
            "loads": entries[::-1], "aggregate": aggregate}


# --------------------------------------------------------------------------- /metrics

SCHEDULER_GAUGES = (
    ("sglang:num_running_reqs", "The number of running requests."),
    ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    ("sglang:num_used_tokens", "The number of used tokens."),
    ("sglang:token_usage", "The token usage."),
    ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("sglang:gen_throughput", "The generation throughput (token/s)."),
    ("sglang:cache_hit_rate", "The prefix cache hit rate."),
    ("sglang:utilization", "The utilization."),
    ("sglang:num_retracted_reqs", "The number of retracted requests."),
)
# Gauges left at prometheus_client's multiprocess_mode "all": the server's merged /metrics
# labels each scheduler process's sample with its pid.
PID_LABELLED = frozenset({"sglang:num_retracted_reqs"})
TOKENIZER_COUNTERS = (
    ("sglang:prompt_tokens_total", "Number of prefill tokens processed."),
    ("sglang:generation_tokens_total", "Number of generation tokens processed."),
    ("sglang:num_requests_total", "Number of requests processed."),
)


def _labels(labels: dict[str, Any]) -> str:
    return ",".join(f'{k}="{labels[k]}"' for k in sorted(labels))


def scheduler_labels(cfg: StandinConfig, layout: Layout, rank: int) -> dict[str, Any]:
    """The scheduler collector's labels; `dp_rank` only where a DP controller runs."""
    attn_tp = cfg.tp_size // layout.attention_width
    labels: dict[str, Any] = {
        "model_name": cfg.served_model_name or cfg.model_path,
        "engine_type": "unified",
        "tp_rank": rank * attn_tp if layout.enable_dp_attention else 0,
        "pp_rank": 0,
        "moe_ep_rank": 0,
    }
    if layout.ranks > 1:
        labels["dp_rank"] = rank
    return labels


def scheduler_pid(rank: int) -> int:
    """The (pretend) process id of rank `rank`'s scheduler."""
    return os.getpid() + 1 + rank


def tokenizer_labels(cfg: StandinConfig, streaming: bool) -> dict[str, Any]:
    labels: dict[str, Any] = {"model_name": cfg.served_model_name or cfg.model_path}
    if cfg.shape == NEWEST:
        labels["engine_type"] = "unified"
        labels["is_streaming"] = "true" if streaming else "false"
    return labels


def metrics_text(cfg: StandinConfig, state: ServerState) -> str:
    lines: list[str] = []
    layout = state.layout
    for name, help_text in SCHEDULER_GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for rank in range(layout.ranks):
            r = state.ranks[rank]
            capacity = cfg.rank_capacity(rank)
            value = {
                "sglang:num_running_reqs": r.running,
                "sglang:num_queue_reqs": r.waiting,
                "sglang:num_used_tokens": r.used_tokens,
                "sglang:token_usage": r.used_tokens / capacity if capacity else 0.0,
                "sglang:max_total_num_tokens": capacity,
                "sglang:num_retracted_reqs": r.retracted,
            }.get(name, 0.0)
            labels = scheduler_labels(cfg, layout, rank)
            if name in PID_LABELLED:
                labels["pid"] = scheduler_pid(rank)
            lines.append(f"{name}{{{_labels(labels)}}} {float(value)}")
    name = "sglang:num_retracted_requests_total"
    lines += [f"# HELP {name} Total number of retracted requests.", f"# TYPE {name} counter"]
    for rank in range(layout.ranks):
        total = state.ranks[rank].retracted_total
        if total is not None:
            lines.append(f"{name}{{{_labels(scheduler_labels(cfg, layout, rank))}}} "
                         f"{float(total)}")
    for name, help_text in TOKENIZER_COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        seen = {streaming: v for (n, streaming), v in state.tokenizer_counters.items()
                if n == name}
        if cfg.shape == NEWEST:
            for streaming, value in sorted(seen.items()):
                lines.append(f"{name}{{{_labels(tokenizer_labels(cfg, streaming))}}} "
                             f"{float(value)}")
        elif seen:
            # 0.5.9 has no is_streaming label: one series.
            lines.append(f"{name}{{{_labels(tokenizer_labels(cfg, False))}}} "
                         f"{float(sum(seen.values()))}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- chat


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "function", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _user_has_content(self) -> Message:
        if self.role == "user" and self.content is None:
            raise ValueError("a user message needs content")
        return self


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatRequest(BaseModel):
    """The fields of SGLang 0.5.9's ChatCompletionRequest the stand-in reads, with their
    types and defaults. No model_config: pydantic's extra="ignore" drops unknown keys."""

    model: str = "default"
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None


class ChatRequest0523(ChatRequest):
    """0.5.23 adds the token-id fields (0.5.9 drops them as unknown)."""

    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_token_ids(messages: list[dict[str, Any]]) -> list[int]:
    """The fake chat template's ids: per message a role marker, one id per word (a crc32 of
    it), an end marker; then the assistant marker the generation starts from."""
    roles = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "function": 5, "developer": 6}
    ids: list[int] = []
    for m in messages:
        ids.append(10 + roles.get(str(m.get("role")), 0))
        ids += [100 + zlib.crc32(w.encode()) % 900 for w in _text_of(m.get("content")).split()]
        ids.append(20)
    return [*ids, 13]


def output_token_ids(n: int, seed: int | None = None) -> list[int]:
    """The ids of n generated tokens: 1000 + position, or, when the server honours seeds
    (--enable-deterministic-inference) and the request has one, a function of the seed."""
    if seed is None:
        return [OUTPUT_ID_BASE + i for i in range(n)]
    return [OUTPUT_ID_BASE + (seed * 7919 + i * 104729) % OUTPUT_ID_SPAN for i in range(n)]


def token_text(token_id: int, reasoning: bool) -> str:
    return f"{'r' if reasoning else 't'}{token_id} "


@dataclass(frozen=True)
class Plan:
    prompt_ids: list[int]
    output_ids: list[int]
    n_reasoning: int  # the first n_reasoning output tokens are the reasoning
    finish_reason: str
    matched_stop: int | None


def plan_reply(cfg: StandinConfig, req: ChatRequest) -> Plan:
    messages = [m.model_dump() for m in req.messages]
    limit = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    kwargs = req.chat_template_kwargs or {}
    thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
    reasoning = cfg.reasoning_tokens if thinking else 0
    natural = reasoning + max(cfg.answer_tokens, req.min_tokens)
    if req.ignore_eos and limit is not None:
        natural = limit
    if limit is not None and natural >= limit:
        n, finish, matched = limit, "length", None
    else:
        n, finish, matched = natural, "stop", EOS_TOKEN_ID
    seed = req.seed if cfg.enable_deterministic_inference else None
    return Plan(prompt_token_ids(messages), output_token_ids(n, seed), min(reasoning, n),
                finish, matched)


def _error_body(message: str, err_type: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": code}


def _usage(cfg: StandinConfig, prompt: int, completion: int, reasoning: int
           ) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                             "completion_tokens": completion, "prompt_tokens_details": None}
    if cfg.shape == NEWEST:
        usage["reasoning_tokens"] = reasoning
        usage["completion_tokens_details"] = (
            {"reasoning_tokens": reasoning} if reasoning else None)
    else:
        usage["reasoning_tokens"] = 0
    return usage


def _delta(cfg: StandinConfig, *, role: str | None = None, content: str | None = None,
           reasoning: str | None = None) -> dict[str, Any]:
    if cfg.shape == NEWEST:
        # msgspec StreamDelta(omit_defaults): reasoning_content always, the rest when set.
        delta: dict[str, Any] = {"reasoning_content": reasoning}
        if role is not None:
            delta["role"] = role
        if content is not None:
            delta["content"] = content
        return delta
    return {"role": role, "content": content, "reasoning_content": reasoning,
            "tool_calls": None}


def _chunk(cfg: StandinConfig, rid: str, created: int, model: str,
           choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
           *, pydantic_dump: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    # 0.5.23 builds delta chunks with msgspec (usage omitted when None); its sglext and
    # usage chunks, and every 0.5.9 chunk, are pydantic dumps with "usage": null.
    if usage is not None or pydantic_dump or cfg.shape != NEWEST:
        chunk["usage"] = usage
    return chunk


def _choice(delta: dict[str, Any], finish: str | None = None,
            matched: int | str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
            "matched_stop": matched}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Generation:
    """One request's life on a DP rank: waiting for a slot, running, maybe retracted."""

    def __init__(self, cfg: StandinConfig, state: ServerState, plan: Plan) -> None:
        self.cfg, self.state, self.plan = cfg, state, plan
        self.rank = state.requests % len(state.ranks)
        self.retract = state.requests < cfg.retract_requests
        state.requests += 1
        self.rid = f"standin-{state.requests}"
        self.r = state.ranks[self.rank]
        self.held = 0

    async def admit(self) -> None:
        """Wait in the rank's queue for a running slot (max_running_requests per rank)."""
        self.r.waiting += 1
        try:
            async with self.state.slot_free:
                await self.state.slot_free.wait_for(
                    lambda: self.r.running < self.cfg.rank_max_running())
                self.r.running += 1
        finally:
            self.r.waiting -= 1
        self._hold(len(self.plan.prompt_ids))

    def _hold(self, tokens: int) -> None:
        self.r.used_tokens += tokens
        self.held += tokens

    async def step(self, i: int) -> None:
        """Before token i is written."""
        if i:
            self._hold(1)
        if self.retract and i == len(self.plan.output_ids) // 2:
            self.retract = False
            self.r.retracted_total = (self.r.retracted_total or 0) + 1
            self.r.running -= 1
            self.r.retracted += 1
            self.r.waiting += 1
            self.r.used_tokens -= self.held
            await asyncio.sleep(self.cfg.token_delay_s)
            self.r.waiting -= 1
            self.r.retracted -= 1
            self.r.running += 1
            self.r.used_tokens += self.held
        if self.cfg.token_delay_s:
            await asyncio.sleep(self.cfg.token_delay_s)

    async def finish(self, streaming: bool, completed: int) -> None:
        self.r.running -= 1
        self.r.used_tokens -= self.held
        self.held = 0
        self.state.count("sglang:prompt_tokens_total", streaming, len(self.plan.prompt_ids))
        self.state.count("sglang:generation_tokens_total", streaming, completed)
        self.state.count("sglang:num_requests_total", streaming, 1)
        async with self.state.slot_free:
            self.state.slot_free.notify_all()


STATE = web.AppKey("standin_state", ServerState)


def make_app(cfg: StandinConfig) -> web.Application:
    state = new_state(cfg)

    def starting() -> bool:
        state.polls += 1
        return state.polls <= cfg.starting_polls

    async def health(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        return web.Response(status=503 if starting() else 200)

    async def info(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        if cfg.old_api and request.path == "/server_info":
            raise web.HTTPNotFound()
        return web.json_response(server_info(cfg, state.layout))

    async def v1_loads(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        if cfg.old_api:
            raise web.HTTPNotFound()
        include_arg = request.query.get("include")
        include = {s.strip() for s in include_arg.split(",")} if include_arg else None
        try:
            rank_arg = request.query.get("dp_rank")
            dp_rank = int(rank_arg) if rank_arg is not None else None
            body = loads(cfg, state, include=include, dp_rank=dp_rank)
        except ValueError as e:
            return web.json_response(_error_body(str(e), "400", 400), status=400)
        return web.json_response(body)

    async def models(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        name = cfg.served_model_name or cfg.model_path
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
             "root": name, "parent": None, "max_model_len": cfg.context_length or 131072}]})

    async def metrics(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        if not cfg.enable_metrics:
            raise web.HTTPNotFound()
        return web.Response(body=metrics_text(cfg, state).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def chat(request: web.Request) -> web.StreamResponse:
        cfg.seen.append(request.path)
        try:
            raw = await request.json()
            model = ChatRequest0523 if cfg.shape == NEWEST else ChatRequest
            req = model.model_validate(raw)
        except (ValueError, ValidationError) as e:
            # http_server.py's RequestValidationError handler: 400, not FastAPI's 422.
            return web.json_response(_error_body(str(e), "Bad Request", 400), status=400)
        if starting():
            return web.json_response(
                _error_body("The server is starting", "Service Unavailable", 503), status=503)
        if not req.messages:  # _validate_request, answered by create_error_response
            return web.json_response(
                _error_body("Messages cannot be empty.", "BadRequestError", 400), status=400)
        if req.n != 1:
            return web.json_response(
                _error_body("the stand-in generates n=1 only", "BadRequest", 400), status=400)
        if req.stream and isinstance(req, ChatRequest0523):
            for name, message in STREAM_REFUSED:
                if getattr(req, name):
                    return web.json_response(_error_body(message, "BadRequest", 400),
                                             status=400)
        gen = Generation(cfg, state, plan_reply(cfg, req))
        if req.stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            events = stream_events(cfg, req, gen)
            try:
                async for event in events:
                    await response.write(event)
            finally:
                await events.aclose()  # a client gone mid-stream frees the slot too
            await response.write_eof()
            return response
        return web.json_response(await complete(cfg, req, gen))

    app = web.Application()
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/server_info", info)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/v1/loads", v1_loads)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _separates_reasoning(cfg: StandinConfig, req: ChatRequest) -> bool:
    return cfg.reasoning_parser is not None and req.separate_reasoning


def _wants_ids(cfg: StandinConfig, req: ChatRequest) -> tuple[bool, bool]:
    """(input ids, output ids) in sglext: 0.5.23 only."""
    if not isinstance(req, ChatRequest0523):
        return False, False
    return (req.return_input_ids_in_sglext,
            req.return_output_ids_in_sglext or cfg.return_output_ids)


async def stream_events(cfg: StandinConfig, req: ChatRequest, gen: Generation
                        ) -> AsyncIterator[bytes]:
    """SGLang's `_generate_chat_stream`, one token per delta chunk."""
    plan = gen.plan
    rid = gen.rid
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    separate = _separates_reasoning(cfg, req)
    n_prompt = len(plan.prompt_ids)
    await gen.admit()
    written = 0
    failed = False
    try:
        yield _sse(_chunk(cfg, rid, created, req.model,
                          [_choice(_delta(cfg, role="assistant", content=""))]))
        for i, token in enumerate(plan.output_ids):
            if cfg.error_after_chunks is not None and i >= cfg.error_after_chunks:
                failed = True
                break
            await gen.step(i)
            in_reasoning = i < plan.n_reasoning
            text = token_text(token, in_reasoning)
            written = i + 1
            reasoning_count = min(written, plan.n_reasoning) if separate else 0
            usage = _usage(cfg, n_prompt, written, reasoning_count) if continuous else None
            delta = (_delta(cfg, reasoning=text) if in_reasoning and separate
                     else _delta(cfg, content=text))
            yield _sse(_chunk(cfg, rid, created, req.model, [_choice(delta)], usage))
        reasoning_count = min(written, plan.n_reasoning) if separate else 0
        if failed and cfg.shape == NEWEST:
            # An abort with a status code: the error object, no finish or ids chunk.
            yield _sse({"error": _error_body("Internal server error (stand-in)",
                                             "INTERNAL_SERVER_ERROR", 500)})
        else:
            finish = "abort" if failed else plan.finish_reason
            matched = None if failed else plan.matched_stop
            yield _sse(_chunk(cfg, rid, created, req.model,
                              [_choice(_delta(cfg), finish, matched)]))
            want_input, want_output = _wants_ids(cfg, req)
            if not failed and (want_input or want_output):
                sglext: dict[str, Any] = {}
                if want_input:
                    sglext["input_ids"] = plan.prompt_ids
                if want_output:
                    sglext["output_ids"] = [plan.output_ids[:written]]
                yield _sse({**_chunk(cfg, rid, created, req.model, [], pydantic_dump=True),
                            "sglext": sglext})
        if include_usage:
            yield _sse(_chunk(cfg, rid, created, req.model, [],
                              _usage(cfg, n_prompt, written, reasoning_count),
                              pydantic_dump=True))
        yield b"data: [DONE]\n\n"
    finally:
        await gen.finish(True, written)


async def complete(cfg: StandinConfig, req: ChatRequest, gen: Generation) -> dict[str, Any]:
    """The non-streaming ChatCompletionResponse."""
    plan = gen.plan
    await gen.admit()
    try:
        for i in range(len(plan.output_ids)):
            await gen.step(i)
    finally:
        await gen.finish(False, len(plan.output_ids))
    separate = _separates_reasoning(cfg, req)
    texts = [token_text(t, i < plan.n_reasoning) for i, t in enumerate(plan.output_ids)]
    cut = plan.n_reasoning if separate else 0
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts[cut:]),
                               "reasoning_content": "".join(texts[:cut]) or None}
    if cfg.shape != NEWEST:
        message["tool_calls"] = None
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                              "finish_reason": plan.finish_reason,
                              "matched_stop": plan.matched_stop}
    body: dict[str, Any] = {
        "id": gen.rid, "object": "chat.completion",
        "created": int(time.time()), "model": req.model, "choices": [choice],
        "usage": _usage(cfg, len(plan.prompt_ids), len(plan.output_ids), cut),
        "metadata": None,
    }
    if isinstance(req, ChatRequest0523):
        if req.return_prompt_token_ids or req.return_token_ids:
            choice["prompt_token_ids"] = plan.prompt_ids
        if req.return_token_ids:
            choice["response_token_ids"] = plan.output_ids
        want_input, want_output = _wants_ids(cfg, req)
        sglext: dict[str, Any] = {}
        if want_input:
            sglext["input_ids"] = plan.prompt_ids
        if want_output:
            sglext["output_ids"] = [plan.output_ids]
        if sglext:
            body["sglext"] = sglext
    return body


async def start_standin(cfg: StandinConfig) -> tuple[web.AppRunner, str]:
    """Serve `cfg` on 127.0.0.1, port 0; returns the runner (to clean up) and the URL.
    Raises what the release would refuse to start with (see `validate_config`)."""
    runner = web.AppRunner(make_app(cfg))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- process


def _probe(argv: list[str]) -> None:
    """`python -c CODE PATH DIST...`: draftgen's install probe, answered as a Python with
    SGLang STANDIN_VERSION installed."""
    version = known_version(os.environ.get("STANDIN_VERSION", NEWEST))
    print(json.dumps(probe_answer(version, argv[3:])), flush=True)


def main(argv: list[str]) -> None:
    """Run as the launched server process (argv: what follows `python`).

    `-c CODE PATH DIST...` is draftgen's install probe; `-m sglang.launch_server FLAGS`
    serves. Environment: STANDIN_VERSION (0.5.23 or 0.5.9; default 0.5.23); STANDIN_MODE
    serve (default), crash, silent, ignore-term; STANDIN_CHILD=1 forks a child into the
    group, like SGLang's schedulers; STANDIN_STARTING_POLLS answers 503 that many times
    first; STANDIN_KV_DTYPE overrides the KV dtype the server reports; STANDIN_OPTIONS, a
    JSON object of any other StandinConfig fields."""
    if argv[:1] == ["-c"]:
        _probe(argv)
        return
    if argv[:1] == ["-m"] and argv[1:2] != ["sglang.launch_server"]:
        print(f"{sys.executable}: No module named {argv[1] if len(argv) > 1 else ''}",
              file=sys.stderr, flush=True)
        sys.exit(1)
    mode = os.environ.get("STANDIN_MODE", "serve")
    print("standin argv:", " ".join(argv), flush=True)
    if mode == "crash":
        print("RuntimeError: CUDA is not available (stand-in crash)", flush=True)
        sys.exit(3)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("STANDIN_CHILD") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child pid:", child.pid, flush=True)
    if mode == "silent":
        time.sleep(600)
    try:
        cfg = parse_launch_argv(argv)
        app = make_app(cfg)
    except (ValueError, AssertionError) as e:
        # SGLang dies with the traceback of what resolution raised.
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        print(f"The server is fired up and ready to roll! port {cfg.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())



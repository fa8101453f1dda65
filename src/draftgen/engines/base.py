"""The engine contract: everything draftgen knows of one inference engine, in one class.

An `Engine` subclass (one folder per engine, beside this file) says how to launch it (the
flags for a profile, by the installed release), how to read a running server's settings
(`read_info`), its load endpoints and metric names, the fields that return token ids, how
it counts a prompt and says its context, how the probe scores on it, and the tune's levers
as this engine spells them. The base class builds the argv (always `python -m module …`,
never a shell), the environment and the URL. `registry.py` maps a profile's `engine:` to
one; nothing outside this folder names an engine.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp

from draftgen.engines.install import EngineInstall, InstallSources, detect_install
from draftgen.engines.load import MetricNames, Reading
from draftgen.engines.scoring import Http, ScoringServer

if TYPE_CHECKING:
    from draftgen.engines.info import ServerInfo, WorkerFacts
    from draftgen.engines.spec import DraftSpec, LaunchSpec
    from draftgen.sample import Message


@dataclass(frozen=True)
class CountRequest:
    """One way to ask a server's `/tokenize` for a prompt's length: the body, and the
    tokens to add to its count (a template the server does not apply there)."""

    body: dict[str, Any]
    added_tokens: int = 0


class Engine(ABC):
    name: ClassVar[str]
    # How people write it ("SGLang"), for messages; what tells its server apart.
    display_name: ClassVar[str]
    signature: ClassVar[str]
    # The module run with `python -m`.
    module: ClassVar[str]
    default_port: ClassVar[int]
    # Where its release and argument parser are read (`install.py`).
    install_sources: ClassVar[InstallSources]
    # Set for every launch, whatever the profile's env says last.
    base_env: ClassVar[Mapping[str, str]] = {}
    # Added to every streamed chat request to a server of this engine: the fields that make
    # it return the prompt's and the answer's token ids. Never sent to another engine.
    token_id_fields: ClassVar[Mapping[str, Any]] = {}
    # Profile features only this engine has ("dp_attention", "deterministic_inference",
    # "hierarchical_cache"); the profile refuses them elsewhere.
    features: ClassVar[frozenset[str]] = frozenset()
    # KV dtypes it has no choice for (as the profile spells them), with the reason.
    refused_kv_dtypes: ClassVar[Mapping[str, str]] = {}

    # Load: a per-rank JSON load endpoint (None: none), its Prometheus names, and the
    # server-info paths that carry the KV capacity.
    loads_path: ClassVar[str | None] = None
    metrics: ClassVar[MetricNames | None] = None
    info_paths: ClassVar[tuple[str, ...]] = ()
    # Where it says its context length, in the order to ask.
    context_paths: ClassVar[tuple[str, ...]] = ("/v1/models",)

    # Tune: the prefill-chunk flag, the speculative-decoding flags that take a value, the
    # lossy KV dtype tried where the profile allows one, the memory fraction it defaults
    # to, the flags that turn DP attention on, and the env var sizing a CPU build's KV.
    chunk_flag: ClassVar[str]
    speculative_flags: ClassVar[tuple[str, ...]] = ()
    lossy_kv_default: ClassVar[str] = "fp8"
    default_mem_fraction: ClassVar[float] = 0.9
    dp_attention_flags: ClassVar[frozenset[str]] = frozenset()
    cpu_kv_env: ClassVar[str | None] = None
    # The flags that turn decode context parallelism on (any of them), and adaptive
    # speculative decoding (None: the engine has none).
    dcp_flags: ClassVar[frozenset[str]] = frozenset()
    speculative_adaptive_flag: ClassVar[str | None] = None

    # --- launch ---------------------------------------------------------------------

    def port(self, profile: LaunchSpec) -> int:
        return self.default_port if profile.port is None else profile.port

    def argv(self, profile: LaunchSpec, *, port: int | None = None,
             install: EngineInstall | None = None) -> list[str]:
        """The exact command, run without a shell; `port` replaces the profile's (e.g. 0).

        `install` is the engine the profile's interpreter has (`installed`); flags
        that differ between releases follow it, or the newest release when it is None."""
        chosen = self.port(profile) if port is None else port
        return [
            profile.interpreter,
            "-m",
            self.module,
            *self.flags(profile, chosen, install),
            *profile.extra_args,
        ]

    @abstractmethod
    def flags(self, profile: LaunchSpec, port: int,
              install: EngineInstall | None = None) -> list[str]: ...

    def installed(self, interpreter: str) -> EngineInstall:
        """This engine as `interpreter` sees it: its release and the flags it defines."""
        return detect_install(self.name, self.install_sources, interpreter)

    def env(self, profile: LaunchSpec) -> dict[str, str]:
        return {**os.environ, **self.base_env, **profile.env}

    def connect_host(self, profile: LaunchSpec) -> str:
        # A server bound to every interface is still reached on loopback from here.
        return "127.0.0.1" if profile.host in ("0.0.0.0", "::", "") else profile.host

    def url(self, profile: LaunchSpec, port: int | None = None) -> str:
        chosen = self.port(profile) if port is None else port
        host = self.connect_host(profile)
        return f"http://[{host}]:{chosen}" if ":" in host else f"http://{host}:{chosen}"

    def running_limit(self, profile: LaunchSpec) -> int | None:
        """The most requests a server launched from `profile` runs at once, where the
        profile sets a limit: the flag's value is each data-parallel replica's own (vLLM's
        --max-num-seqs per engine core, SGLang's --max-running-requests per DP worker)."""
        n = profile.max_running_requests
        return None if n is None else n * profile.dp

    def profile_problem(self, profile: LaunchSpec) -> str | None:
        """Why this engine cannot run `profile`'s settings, or None."""
        refused = self.refused_kv_dtypes.get(profile.kv_cache_dtype)
        return f"kv_cache_dtype: {refused}" if refused else None

    def cpu_server(self, python: str, model_dir: Path, *, served_name: str, port: int,
                   max_model_len: int, num_blocks: int | None, kv_cache_gib: int
                   ) -> tuple[list[str], dict[str, str]] | None:
        """The argv and environment additions of a CPU build serving `model_dir` on
        127.0.0.1 (the local engine of the demo and tests); None: no CPU build."""
        return None

    # --- a running server -----------------------------------------------------------

    @abstractmethod
    async def read_info(
        self, session: aiohttp.ClientSession, url: str, *, profile: LaunchSpec | None = None
    ) -> ServerInfo | None:
        """The running server's settings, or None when `url` is not this engine."""

    def gateway_info(self, url: str, metrics: str, facts: WorkerFacts, *,
                     profile: LaunchSpec | None = None) -> ServerInfo | None:
        """The settings of a worker reached only through a gateway, from its Prometheus page
        as the gateway relays it (`metrics`) and what the gateway says of it (`facts`); None
        when they do not say (this engine keeps its settings elsewhere) or it is not this
        engine."""
        return None

    def read_loads(self, body: object) -> Reading | None:
        """The load fields of a `loads_path` answer, or None when it is not one."""
        return None

    def info_capacity(self, body: object) -> float | None:
        """KV tokens over all ranks from a server-info answer, if it says."""
        return None

    def context_in(self, body: object) -> int | None:
        """The context length a `context_paths` answer gives, or None."""
        data = body.get("data") if isinstance(body, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            value = data[0].get("max_model_len")
            return value if isinstance(value, int) and value > 0 else None
        return None

    def count_requests(self, model: str, messages: Sequence[Message]) -> list[CountRequest]:
        """The `/tokenize` bodies to try in order for a prompt's length (its template and
        generation prompt included)."""
        # No `add_generation_prompt`: the server adds it as for a chat completion.
        return [CountRequest({"model": model, "messages": list(messages)})]

    @abstractmethod
    async def scorer(self, http: Http, url: str, model: str | None) -> ScoringServer | None:
        """The probe's scorer for the server at `url`, or None when it is not this engine."""

    # --- tune levers ----------------------------------------------------------------

    @abstractmethod
    def prefix_cache_on(self, args: Sequence[str]) -> bool:
        """Whether a server launched with these extra args keeps a prefix cache."""

    @abstractmethod
    def with_prefix_cache(self, args: Sequence[str], on: bool) -> list[str]:
        """`args` with the prefix cache turned on or off."""

    @abstractmethod
    def speculative_args(self, spec: DraftSpec) -> list[str]:
        """The flags that run the profile's draft."""

    def speculative_adaptive_problem(self, profile: LaunchSpec) -> str | None:
        """Why adaptive speculative decoding would not run for `profile` (with its
        `tune.speculative` draft), or None where it would."""
        return f"{self.display_name} has no adaptive speculative decoding"

"""The engine contract: how to launch one, and how to read what a running one actually uses.

An `Engine` subclass writes two things: the flags for a profile (`flags`) and how to read a
running server's settings into a `ServerInfo` (`read_info`). The base class builds the
argv (always `python -m module …`, never a shell), the environment and the URL.

`ServerInfo` is what the server reports, never what we asked for: the quality policy checks
it, `run` records it in the manifest, and `serve` prints it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from draftgen.errors import DraftgenError
from draftgen.servers.install import EngineInstall
from draftgen.servers.profile import ServerProfile

_INFO_TIMEOUT_S = 30.0


class ServerInfoError(DraftgenError):
    """A server could not be reached or did not answer like SGLang or vLLM."""


@dataclass(frozen=True)
class ServerInfo:
    url: str
    engine: str
    version: str | None = None
    # The name requests use, and the weights behind it.
    model: str | None = None
    model_path: str | None = None
    # The KV dtype the server really stores, canonical (`bfloat16`, `fp8_e4m3`); None when it
    # could not be determined. `kv_dtype_setting` is the server's own setting (e.g. `auto`),
    # `kv_dtype_note` says how `kv_dtype` was found.
    kv_dtype: str | None = None
    kv_dtype_setting: str | None = None
    kv_dtype_note: str = ""
    # KV capacity in tokens: the sum over data-parallel ranks, and each rank's share.
    kv_tokens: int | None = None
    kv_tokens_per_rank: tuple[int, ...] = ()
    max_running_requests: int | None = None
    mem_fraction: float | None = None
    context_length: int | None = None
    tp: int | None = None
    dp: int | None = None
    # SGLang data-parallel attention ranks (`attn_dp_size`; 0.5.23 reports dp_size 1 then).
    attn_dp: int | None = None
    # Whether the server honours a request's `seed`: vLLM does; SGLang only when launched
    # with --enable-deterministic-inference. None: unknown.
    seeds_honoured: bool | None = None
    # The server's own arguments that bear on capacity and quality, as it reported them.
    args: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["kv_tokens_per_rank"] = list(self.kv_tokens_per_rank)
        data["args"] = dict(self.args)
        return data

    def identity(self) -> dict[str, Any]:
        """The settings that, when they change, make it a different server for a run."""
        return {
            "engine": self.engine,
            "version": self.version,
            "model": self.model,
            "model_path": self.model_path,
            "kv_dtype": self.kv_dtype,
            "kv_tokens": self.kv_tokens,
            "kv_tokens_per_rank": list(self.kv_tokens_per_rank),
            "max_running_requests": self.max_running_requests,
            "mem_fraction": self.mem_fraction,
            "context_length": self.context_length,
            "attn_dp": self.attn_dp,
            "seeds_honoured": self.seeds_honoured,
        }

    def configuration(self) -> dict[str, Any]:
        """What decides the text this server writes: the same configuration, the same
        model behaviour. Every record names its server's (see `configuration_id`)."""
        return {
            "engine": self.engine,
            "version": self.version,
            "model_path": self.model_path,
            "kv_dtype": self.kv_dtype,
            "dtype": self.args.get("dtype"),
            "quantization": self.args.get("quantization"),
            "speculative": self.args.get("speculative_algorithm"),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["kv_tokens_per_rank"] = tuple(kwargs.get("kv_tokens_per_rank") or ())
        return cls(**kwargs)


def configuration_id(configuration: Mapping[str, Any]) -> str:
    """A short stable name for a server configuration (a hash of it)."""
    text = json.dumps(dict(configuration), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


class Engine(ABC):
    name: ClassVar[str]
    # The module run with `python -m`.
    module: ClassVar[str]
    default_port: ClassVar[int]
    # Set for every launch, whatever the profile's env says last.
    base_env: ClassVar[Mapping[str, str]] = {}
    # Added to every streamed chat request to a server of this engine: the fields that make
    # it return the prompt's and the answer's token ids. Never sent to another engine.
    token_id_fields: ClassVar[Mapping[str, Any]] = {}

    def port(self, profile: ServerProfile) -> int:
        return self.default_port if profile.port is None else profile.port

    def argv(self, profile: ServerProfile, *, port: int | None = None,
             install: EngineInstall | None = None) -> list[str]:
        """The exact command, run without a shell; `port` replaces the profile's (e.g. 0).

        `install` is the engine the profile's interpreter has (`detect_install`); flags
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
    def flags(self, profile: ServerProfile, port: int,
              install: EngineInstall | None = None) -> list[str]: ...

    def env(self, profile: ServerProfile) -> dict[str, str]:
        return {**os.environ, **self.base_env, **profile.env}

    def connect_host(self, profile: ServerProfile) -> str:
        # A server bound to every interface is still reached on loopback from here.
        return "127.0.0.1" if profile.host in ("0.0.0.0", "::", "") else profile.host

    def url(self, profile: ServerProfile, port: int | None = None) -> str:
        chosen = self.port(profile) if port is None else port
        host = self.connect_host(profile)
        return f"http://[{host}]:{chosen}" if ":" in host else f"http://{host}:{chosen}"

    @abstractmethod
    async def read_info(
        self, session: aiohttp.ClientSession, url: str, *, profile: ServerProfile | None = None
    ) -> ServerInfo | None:
        """The running server's settings, or None when `url` is not this engine."""


def common_flags(profile: ServerProfile, port: int, *, model_flag: str) -> list[str]:
    args = [model_flag, profile.model_path]
    if profile.served_name:
        args += ["--served-model-name", profile.served_name]
    return [*args, "--host", profile.host, "--port", str(port)]


async def get_json(session: aiohttp.ClientSession, url: str) -> Any | None:
    """The JSON body at `url`, or None for 404/405 (the endpoint does not exist here)."""
    text = await get_text(session, url)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


async def get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=_INFO_TIMEOUT_S)) as r:
            if r.status in (404, 405):
                return None
            if r.status >= 400:
                raise ServerInfoError(f"GET {url}: HTTP {r.status}")
            return await r.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ServerInfoError(f"GET {url}: {type(e).__name__}: {e}") from None


def read_model_config(model_path: str | None) -> dict[str, Any] | None:
    """config.json of a model on this machine's disk, or None (a hub id, another host)."""
    if not model_path:
        return None
    try:
        raw = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def checkpoint_kv_scheme(model_path: str | None) -> str | None:
    """The quantized KV scheme a checkpoint declares, which `auto` may silently adopt."""
    config = read_model_config(model_path) or {}
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        for key in ("kv_cache_scheme", "kv_cache_quant_algo", "kv_cache_dtype"):
            if quant.get(key):
                return f"quantization_config.{key}={json.dumps(quant[key], sort_keys=True)}"
    if model_path:
        # ModelOpt checkpoints keep it in hf_quant_config.json.
        try:
            hf_quant = json.loads(
                (Path(model_path).expanduser() / "hf_quant_config.json").read_text()
            )
        except (OSError, ValueError):
            hf_quant = None
        algo = (hf_quant or {}).get("quantization", {}).get("kv_cache_quant_algo")
        if algo:
            return f"hf_quant_config.json kv_cache_quant_algo={algo}"
    return None


def resolve_auto_kv_dtype(
    model_path: str | None, model_dtype: str | None
) -> tuple[str | None, str]:
    """What `auto` means for this model: (dtype or None, how we know).

    `auto` takes the model's dtype unless the checkpoint declares a quantized KV scheme;
    both are read from the model folder when it is on this machine.
    """
    scheme = checkpoint_kv_scheme(model_path)
    if scheme:
        return "fp8", f"auto, and the checkpoint declares a quantized KV cache ({scheme})"
    if model_dtype and model_dtype != "auto":
        return model_dtype, f"auto → the model dtype {model_dtype} (server setting)"
    config = read_model_config(model_path)
    if config is not None:
        dtype = config.get("torch_dtype") or config.get("dtype")
        if isinstance(dtype, str):
            return dtype, f"auto → the model dtype {dtype} (config.json of {model_path})"
    return None, "auto, and the model dtype could not be read (model not on this machine)"


def model_max_len(models: Any) -> int | None:
    """`max_model_len` of the first model in a /v1/models answer."""
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return as_int(data[0].get("max_model_len"))
    return None


def as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
        return int(f) if f.is_integer() else None
    return None


def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def as_str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None

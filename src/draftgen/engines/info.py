"""What a running server reports about itself, whichever engine it is.

`ServerInfo` is what the server says, never what we asked for: the quality policy checks
it, `run` records it in the manifest, and `serve` prints it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from draftgen.errors import DraftgenError


class ServerInfoError(DraftgenError):
    """A server could not be reached or did not answer like SGLang or vLLM."""


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What a gateway says of a worker beside its relayed metrics, standing in for the
    worker's own version and model endpoints (each gateway maps its worker list to these:
    gateways/); None: not said."""

    version: str | None = None
    served_name: str | None = None
    model_path: str | None = None
    context_length: int | None = None


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

"""A server profile: how to launch one inference server, as one validated object from YAML.

Like the job spec, every model forbids unknown keys and `load_profile` turns any problem
into a `JobError` naming the file and the field. Paths in a profile are relative to the
profile file. The KV cache dtype is validated here only for shape; whether it is allowed is
the quality policy's decision (`servers/policy.py`), so `serve --dry-run` can explain it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from draftgen.servers.dtypes import canonical_kv_dtype
from draftgen.servers.tuning import TuneSpace
from draftgen.yamlfile import load_model

EngineName = Literal["sglang", "vllm"]

# Flags the profile owns. Given again in extra_args they would silently override a field,
# and `--kv-cache-dtype` there would slip past the quality policy.
MANAGED_FLAGS = frozenset(
    {
        "--model", "--model-path", "--served-model-name", "--host", "--port",
        "--tp", "--tp-size", "--tensor-parallel-size", "--dp", "--dp-size",
        "--data-parallel-size", "--enable-dp-attention", "--mem-fraction-static",
        "--gpu-memory-utilization", "--enable-hierarchical-cache", "--hicache-size",
        "--kv-cache-dtype", "--reasoning-parser", "--max-running-requests", "--max-num-seqs",
        "--context-length", "--max-model-len", "--dtype", "--attn-dp-size",
        "--enable-deterministic-inference",
    }
)  # fmt: skip

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HierarchicalCache(_Strict):
    """SGLang keeps evicted prefix cache in host RAM; it does not add room for running requests."""

    enabled: bool = False
    # --hicache-size: host memory per rank, in whole GB.
    host_gb_per_rank: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _size_needs_enabled(self) -> HierarchicalCache:
        if self.host_gb_per_rank is not None and not self.enabled:
            raise ValueError("host_gb_per_rank is set but enabled is false")
        return self


class Quality(_Strict):
    # The one way to accept a lossy KV cache; stamped into every run manifest that uses it.
    allow_lossy_kv_cache: bool = False
    # Why the loss is acceptable; copied into the stamp.
    reason: str | None = None


class ServerProfile(_Strict):
    engine: EngineName
    model_path: str = Field(min_length=1)
    # The name requests use; defaults to the engine's own choice (usually the model path).
    served_name: str | None = None
    # The server's directory under state_dir; defaults to served_name or the model's folder.
    name: str | None = Field(default=None, pattern=_NAME.pattern)
    tp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    # SGLang data-parallel attention over `dp` ranks inside the TP group (MLA models):
    # `--attn-dp-size dp` where the installed SGLang has it, else `--dp-size dp
    # --enable-dp-attention` (deprecated in 0.5.23).
    dp_attention: bool = False
    # SGLang ignores a request's `seed` unless launched with --enable-deterministic-inference
    # (which restricts backends and costs speed); vLLM honours seeds without it.
    deterministic_inference: bool = False
    # --mem-fraction-static (SGLang) / --gpu-memory-utilization (vLLM).
    mem_fraction: float | None = Field(default=None, gt=0, le=1)
    hierarchical_cache: HierarchicalCache = Field(default_factory=HierarchicalCache)
    # Explicit 16-bit by default: left to `auto`, an engine may pick fp8 from the checkpoint.
    kv_cache_dtype: str = "bfloat16"
    # The model's weights/activations dtype (--dtype); the engine decides when unset.
    model_dtype: str | None = None
    reasoning_parser: str | None = None
    # --max-running-requests (SGLang) / --max-num-seqs (vLLM).
    max_running_requests: int | None = Field(default=None, ge=1)
    # --context-length (SGLang) / --max-model-len (vLLM).
    context_length: int | None = Field(
        default=None, ge=1, validation_alias=AliasChoices("context_length", "max_model_len")
    )
    host: str = "127.0.0.1"
    # None: the engine's default port (SGLang 30000, vLLM 8000); 0: a free port at start.
    port: int | None = Field(default=None, ge=0, le=65535)
    # The interpreter that runs the engine; default: the one running draftgen.
    python: str | None = None
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    quality: Quality = Field(default_factory=Quality)
    # Where pid, log and state files go; default ~/.cache/draftgen/servers.
    state_dir: str | None = None
    # What `draftgen tune` may try (servers/tuning.py); not a server setting.
    tune: TuneSpace | None = None

    @field_validator("kv_cache_dtype", "model_dtype")
    @classmethod
    def _dtype_shape(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not re.fullmatch(r"[A-Za-z0-9_-]+", v.strip()):
            raise ValueError(f"{v!r} is not a dtype name")
        return v.strip().lower()

    @field_validator("kv_cache_dtype")
    @classmethod
    def _one_spelling(cls, v: str) -> str:
        # `bf16` and `bfloat16` are one setting: one spelling keeps the profile hash stable.
        return canonical_kv_dtype(v)

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, v: Any) -> Any:
        # YAML reads `VLLM_CPU_KVCACHE_SPACE: 1` as an int; the environment holds strings.
        if isinstance(v, dict):
            return {k: v2 if isinstance(v2, str) else json.dumps(v2) for k, v2 in v.items()}
        return v

    @field_validator("extra_args", mode="before")
    @classmethod
    def _args_as_strings(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [a if isinstance(a, str) else json.dumps(a) for a in v]
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> ServerProfile:
        if self.dp_attention and self.engine != "sglang":
            raise ValueError("dp_attention: only SGLang has data-parallel attention")
        if self.deterministic_inference and self.engine != "sglang":
            raise ValueError("deterministic_inference: only SGLang needs it; vLLM honours "
                             "per-request seeds as it is")
        if self.dp_attention and (self.dp < 2 or self.tp % self.dp):
            raise ValueError("dp_attention: needs dp >= 2 and tp divisible by dp")
        if self.engine == "sglang" and self.kv_cache_dtype in ("float16", "float32"):
            raise ValueError(
                "kv_cache_dtype: SGLang's explicit 16-bit KV dtype is bfloat16 (bf16); "
                f"it has no {self.kv_cache_dtype} choice"
            )
        if self.hierarchical_cache.enabled and self.engine != "sglang":
            raise ValueError("hierarchical_cache: only SGLang has --enable-hierarchical-cache")
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0].replace("_", "-")
            if flag in MANAGED_FLAGS:
                raise ValueError(
                    f"extra_args: {arg!r} is set by a profile field; use the field instead"
                )
        return self

    _source_file: Path | None = PrivateAttr(default=None)

    @property
    def source_file(self) -> Path | None:
        return self._source_file

    @property
    def server_name(self) -> str:
        """The folder under state_dir that holds this server's pid, log and state."""
        if self.name:
            return self.name
        base = self.served_name or Path(self.model_path.rstrip("/")).name or "server"
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.") or "server"

    @property
    def interpreter(self) -> str:
        return self.python or sys.executable

    @property
    def state_path(self) -> Path:
        return (Path(self.state_dir) if self.state_dir else default_state_dir()) / self.server_name



def default_state_dir() -> Path:
    """~/.cache/draftgen/servers, or $DRAFTGEN_SERVERS_DIR."""
    env = os.environ.get("DRAFTGEN_SERVERS_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    root = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return root / "draftgen" / "servers"


def profile_hash(profile: ServerProfile) -> str:
    """A stable hash of what the server runs with: same hash, same server settings.

    Bookkeeping (state_dir, name) and the `tune` section are left out: moving the state
    files, or listing what a tune may try, changes no token.
    """
    data = profile.model_dump(mode="json", exclude={"state_dir", "name", "tune"})
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _resolve_path(value: str, base: Path, *, must_exist_unless_explicit: bool) -> str:
    """Paths resolve from the profile's directory; a bare `org/model` hub id stays as is."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    explicit = value.startswith(("./", "../", "~")) or value in (".", "..")
    candidate = (base / p).resolve()
    if explicit or not must_exist_unless_explicit or candidate.exists():
        return str(candidate)
    return value


def resolve_paths(profile: ServerProfile, base_dir: Path) -> ServerProfile:
    """The profile with model_path, python and state_dir resolved from `base_dir`."""
    update: dict[str, Any] = {
        "model_path": _resolve_path(profile.model_path, base_dir, must_exist_unless_explicit=True)
    }
    # A bare interpreter name (`python3`) is looked up on PATH, like a shell would.
    if profile.python and "/" in profile.python:
        update["python"] = _resolve_path(profile.python, base_dir, must_exist_unless_explicit=False)
    if profile.state_dir:
        update["state_dir"] = _resolve_path(
            profile.state_dir, base_dir, must_exist_unless_explicit=False
        )
    spec = profile.tune.speculative if profile.tune else None
    if profile.tune and spec and spec.draft_model:
        # Like model_path: a folder next to the profile, or a hub id left as it is.
        draft = _resolve_path(spec.draft_model, base_dir, must_exist_unless_explicit=True)
        update["tune"] = profile.tune.model_copy(
            update={"speculative": spec.model_copy(update={"draft_model": draft})})
    resolved = profile.model_copy(update=update)
    resolved._source_file = profile._source_file
    return resolved


def load_profile(path: str | Path) -> ServerProfile:
    """Read and validate a profile file; relative paths in it resolve from its directory."""
    profile = load_model(path, ServerProfile, "server profile")
    profile._source_file = Path(path).resolve()
    return resolve_paths(profile, Path(path).resolve().parent)

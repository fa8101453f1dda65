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
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from draftgen.engines.dtypes import canonical_kv_dtype
from draftgen.engines.registry import ENGINE_NAMES, engine_for, with_feature
from draftgen.servers.tune_section import TuneSpace
from draftgen.yamlfile import load_model

if TYPE_CHECKING:
    EngineName = str
else:  # the registry's names, so pydantic lists them when a profile names another
    EngineName = Literal[ENGINE_NAMES]
# What a feature is called in messages, and the profile fields that ask for it.
_FEATURES = {
    "dp_attention": "data-parallel attention",
    "deterministic_inference": "--enable-deterministic-inference",
    "hierarchical_cache": "--enable-hierarchical-cache",
    "dcp": "decode context parallelism",
}

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
        "--enable-deterministic-inference", "--dcp-size", "--decode-context-parallel-size",
    }
)  # fmt: skip

# A server's (or gateway's) folder name under the state directory.
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
_NAME = re.compile(NAME_PATTERN)


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


class ProbeSettings(_Strict):
    """How `draftgen tune` probes a candidate against this profile's server (and the
    defaults `draftgen probe` can be given on its command line): the size of the probe, and
    the gate's confidence and tolerances (`probe/gate.py`)."""

    prompts: int = Field(default=16, ge=2)
    max_tokens: int = Field(default=32, ge=1)
    top_k: int = Field(default=10, ge=1)
    confidence: float = Field(default=0.99, gt=0.5, lt=1)
    kl_margin: float = Field(default=0.0, ge=0)
    top1_margin: float = Field(default=0.0, ge=0, le=1)
    detect_kl: float = Field(default=1e-3, gt=0)
    cache_read: bool = True


class Quality(_Strict):
    # The one way to accept a lossy KV cache; stamped into every run manifest that uses it.
    allow_lossy_kv_cache: bool = False
    # Why the loss is acceptable; copied into the stamp.
    reason: str | None = None
    probe: ProbeSettings = Field(default_factory=ProbeSettings)


class MeasuredKV(_Strict):
    """A KV capacity a server of this model really reported, and what it ran with: the point
    the memory model fits its one unknown to (`engines/memory.py`)."""

    kv_tokens: int = Field(ge=1)
    mem_fraction: float = Field(gt=0, le=1)
    kv_cache_dtype: str = "bfloat16"
    tp: int | None = Field(default=None, ge=1)  # None: the profile's
    dp: int = Field(default=1, ge=1)
    dp_attention: bool = False
    dcp: int = Field(default=1, ge=1)
    # Where the figure comes from (a log line, a run, an account).
    source: str | None = None


class Memory(_Strict):
    """Facts for the memory model where they are not on this machine; not a server setting."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # The model's config.json (a file or a folder holding one), when `model_path` is not here.
    model_config_path: str | None = Field(default=None, alias="model_config")
    # One GPU's memory as the driver reports it (nvidia-smi's MiB), when no GPU is visible.
    gpu_memory_mib: int | None = Field(default=None, ge=1)
    # The checkpoint's size in decimal GB (its safetensors index's `total_size` / 1e9), when
    # the files are elsewhere.
    weights_gb: float | None = Field(default=None, gt=0)
    measured: MeasuredKV | None = None


class Speed(_Strict):
    """The decode speed predictions assume where nothing was measured on this server:
    (running requests, output tok/s) pairs, and where they come from."""

    points: list[tuple[float, float]] = Field(min_length=1)
    source: str | None = None

    @field_validator("points")
    @classmethod
    def _positive(cls, v: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if any(b <= 0 or r <= 0 for b, r in v):
            raise ValueError("each point is (running requests, tok/s), both above 0")
        return v


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
    # Decode context parallelism: each KV pool's tokens sharded over `dcp` GPUs of the
    # attention TP group (SGLang --dcp-size, vLLM --decode-context-parallel-size): for an MLA
    # model, whose latent KV plain TP copies onto every GPU, up to `dcp` times the tokens.
    dcp: int = Field(default=1, ge=1)
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
    # What `draftgen tune` may try (servers/tune_section.py); not a server setting.
    tune: TuneSpace | None = None
    # Facts for the memory model (`serve --dry-run`, `plan --profile`); not a server setting.
    memory: Memory | None = None
    # The decode speed `plan --profile` and `tune --dry-run` assume; not a server setting.
    speed: Speed | None = None

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
        engine = engine_for(self.engine)
        asked = {"dp_attention": self.dp_attention,
                 "deterministic_inference": self.deterministic_inference,
                 "hierarchical_cache": self.hierarchical_cache.enabled,
                 "dcp": self.dcp > 1}
        for feature, on in asked.items():
            if on and feature not in engine.features:
                having = " and ".join(e.display_name for e in with_feature(feature))
                raise ValueError(f"{feature}: only {having} has {_FEATURES[feature]}; "
                                 f"{engine.display_name} does not")
        if self.dp_attention and (self.dp < 2 or self.tp % self.dp):
            raise ValueError("dp_attention: needs dp >= 2 and tp divisible by dp")
        attn_tp = self.tp // self.dp if self.dp_attention else self.tp
        if attn_tp % self.dcp:
            raise ValueError(f"dcp: {self.dcp} must divide the attention TP group "
                             f"({attn_tp} GPUs)")
        if (problem := engine.profile_problem(self)) is not None:
            raise ValueError(problem)
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

    Bookkeeping (state_dir, name) and the `tune`, `memory` and `speed` sections are left
    out: moving the state files, listing what a tune may try, or facts for predictions
    change no token.
    """
    data = profile.model_dump(mode="json",
                              exclude={"state_dir", "name", "tune", "memory", "speed"})
    if data.get("dcp") == 1:  # the default leaves the hash of every earlier profile as it was
        del data["dcp"]
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


def resolve_relative(value: str, base: Path) -> str:
    """A path given in a profile file, resolved from the file's directory."""
    return _resolve_path(value, base, must_exist_unless_explicit=False)


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
    memory = profile.memory
    if memory is not None and memory.model_config_path:
        update["memory"] = memory.model_copy(update={"model_config_path": str(
            (base_dir / Path(memory.model_config_path).expanduser()).resolve())})
    resolved = profile.model_copy(update=update)
    resolved._source_file = profile._source_file
    return resolved


def load_profile(path: str | Path) -> ServerProfile:
    """Read and validate a profile file; relative paths in it resolve from its directory."""
    profile = load_model(path, ServerProfile, "server profile")
    profile._source_file = Path(path).resolve()
    return resolve_paths(profile, Path(path).resolve().parent)

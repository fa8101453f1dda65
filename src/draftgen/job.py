"""The job spec: one validated object built from a YAML file.

Every model forbids unknown keys so a typo is an error, not a silently ignored setting.
`load_job` turns any problem into a `JobError` that names the file and the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from draftgen.errors import JobError
from draftgen.yamlfile import load_model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def url_problem(url: str) -> str | None:
    """What is wrong with `url` as a server's base URL (http or https, a host, a valid
    port, no spaces), or None: checked before anything connects, so it never surfaces as an
    HTTP library's exception."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not parts.hostname:
        return f"{url!r} names no host"
    if any(c.isspace() for c in url):
        return f"{url!r} contains whitespace"
    try:
        _ = parts.port  # parsing it is the check
    except ValueError:
        return f"{url!r} has an invalid port"
    return None


class Sampling(_Strict):
    """Sampling parameters sent with every request; part of each request's fingerprint."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    # Engine-specific keys merged into the request body, e.g. chat_template_kwargs.
    extra_body: dict[str, Any] = Field(default_factory=dict)


class Partition(_Strict):
    """A class of requests sharing an output budget and a concurrency limit."""

    max_tokens: int = Field(gt=0)
    concurrency: int = Field(default=32, gt=0)
    # With `partition: auto`, a prompt goes to the partition with the largest
    # min_prompt_tokens that it reaches.
    min_prompt_tokens: int = Field(default=0, ge=0)
    # What becomes of answers cut at max_tokens: drop (left out of exports), keep (exported,
    # tagged), escalate (`run --rerun-truncated` sends them again in `escalate_to`).
    truncation: Literal["drop", "keep", "escalate"] = "drop"
    escalate_to: str | None = None


Layout = Literal["messages", "conversations", "prompt"]


class Source(_Strict):
    """Where a category's prompts come from."""

    path: str | None = None
    hf_dataset: str | None = None
    hf_split: str = "train"
    hf_config: str | None = None
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    layout: Layout = "messages"
    # Field names: `messages` / `conversations` list, or the single prompt text field.
    field: str | None = None
    id_field: str | None = None

    @model_validator(mode="after")
    def _one_origin(self) -> Source:
        if (self.path is None) == (self.hf_dataset is None):
            raise ValueError("give exactly one of 'path' or 'hf_dataset'")
        return self

    @property
    def field_name(self) -> str:
        return self.field or self.layout


class Category(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    source: Source
    system_prompt: str | None = None
    cap: int | None = Field(default=None, ge=0)
    partition: str = "auto"


class Server(_Strict):
    """A running server (`url`), a gateway in front of workers (`gateway`), or a server
    profile to launch for the run (`launch`)."""

    url: str | None = None
    # A gateway (the SGLang Model Gateway): its workers are found, verified one by one and
    # kept fresh while the run goes; each is addressed through the gateway.
    gateway: str | None = None
    # The profile an already running `url` (or every worker of `gateway`) was started from:
    # its quality override applies.
    profile: str | None = None
    # Started before the run (under OUT/servers, on a free port) and stopped after it.
    launch: str | None = None
    # Server profiles launched for the run as the workers of a gateway (the SGLang Model
    # Gateway, started in front of them); all stopped after it.
    workers: list[str] | None = Field(default=None, min_length=1)

    @field_validator("url", "gateway")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        if v is not None and (problem := url_problem(v)) is not None:
            raise ValueError(problem)
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _one_kind(self) -> Server:
        if sum(v is not None for v in (self.url, self.gateway, self.launch, self.workers)) != 1:
            raise ValueError("give exactly one of 'url', 'gateway', 'launch' or 'workers'")
        if self.profile is not None and (self.launch or self.workers) is not None:
            raise ValueError("'profile' goes with 'url' or 'gateway'; 'launch' and "
                             "'workers' already name their profiles")
        return self


class Retry(_Strict):
    max_attempts: int = Field(default=6, ge=1)
    backoff_base_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=60.0, gt=0)


class Client(_Strict):
    # Seconds with no streamed byte before a request counts as stalled; never a total limit.
    idle_timeout_s: float = Field(default=300.0, gt=0)
    connect_timeout_s: float = Field(default=30.0, gt=0)
    # No token on any in-flight request of a server for this long: the server is hung.
    hang_timeout_s: float = Field(default=180.0, gt=0)
    # A liveness probe (a 1-token generation) that takes longer than this failed.
    probe_timeout_s: float = Field(default=30.0, gt=0)
    # Stop the run when every server has been down this long; None waits indefinitely.
    server_down_give_up_s: float | None = Field(default=None, gt=0)
    # A sample caught in this many outages is then charged retries like any transient error.
    max_outage_requeues: int = Field(default=50, ge=1)
    retry: Retry = Field(default_factory=Retry)


class JobSpec(_Strict):
    model: str = Field(min_length=1)
    # A local tokenizer.json (or a directory holding one) for exact prompt token counts.
    tokenizer: str | None = None
    servers: list[Server] = Field(default_factory=list)
    # The API key comes from an environment variable or a file, never from the job itself.
    api_key_env: str | None = None
    api_key_file: str | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    partitions: dict[str, Partition] = Field(min_length=1)
    categories: list[Category] = Field(min_length=1)
    samples_per_prompt: int = Field(default=1, ge=1)
    # A prompt that fits the servers' context but leaves less than max_tokens for the
    # answer: shorten (send it with the max_tokens that fit) or set_aside (a rejected row).
    over_context: Literal["shorten", "set_aside"] = "shorten"
    multi_turn: Literal["last", "all"] = "last"
    seed: int = 0
    # adaptive: admit by expected KV footprint against each server's capacity, corrected
    # from its load; static: each partition's fixed `concurrency`.
    scheduler: Literal["adaptive", "static"] = "adaptive"
    # prefix: send prompts that share a system prompt / opening text together (prefix cache).
    order: Literal["plan", "prefix"] = "plan"
    poll_interval_s: float = Field(default=1.0, gt=0)
    output: str = "runs/out"
    client: Client = Field(default_factory=Client)
    progress_interval_s: float = Field(default=30.0, gt=0)

    @field_validator("servers", mode="before")
    @classmethod
    def _urls_as_servers(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"url": s} if isinstance(s, str) else s for s in v]
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give api_key_env or api_key_file, not both")
        names = [c.name for c in self.categories]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate category names: {sorted(dup)}")
        for name, p in self.partitions.items():
            if (p.truncation == "escalate") != (p.escalate_to is not None):
                raise ValueError(f"partitions.{name}: 'truncation: escalate' and 'escalate_to' "
                                 "go together")
            target = self.partitions.get(p.escalate_to or "")
            if p.escalate_to is not None and (target is None or
                                              target.max_tokens <= p.max_tokens):
                raise ValueError(f"partitions.{name}.escalate_to: {p.escalate_to!r} must be "
                                 "another partition with a larger max_tokens")
        for i, c in enumerate(self.categories):
            if c.partition != "auto" and c.partition not in self.partitions:
                raise ValueError(
                    f"categories.{i}.partition: {c.partition!r} is not one of "
                    f"{sorted(self.partitions)} or 'auto'"
                )
        return self

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source_file: Path | None = PrivateAttr(default=None)

    @property
    def source_file(self) -> Path | None:
        return self._source_file

    def resolve(self, p: str) -> Path:
        """Paths in a job file are relative to the file's directory."""
        path = Path(p).expanduser()
        return path if path.is_absolute() else self._base_dir / path


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job file; relative paths in it resolve from its directory."""
    job = load_model(path, JobSpec, "job file")
    job._base_dir = Path(path).resolve().parent
    job._source_file = Path(path).resolve()
    return job


def read_api_key(job: JobSpec) -> str | None:
    """The key itself is never logged, stored or echoed; errors name only where it lives."""
    if job.api_key_env is not None:
        key = os.environ.get(job.api_key_env, "").strip()
        if not key:
            raise JobError(f"api_key_env: environment variable {job.api_key_env} is not set")
        return _header_safe(key, f"api_key_env: the key in {job.api_key_env}")
    if job.api_key_file is not None:
        path = job.resolve(job.api_key_file)
        try:
            key = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise JobError(f"api_key_file: cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise JobError(f"api_key_file: {path} is not UTF-8 text") from None
        if not key:
            raise JobError(f"api_key_file: {path} is empty")
        return _header_safe(key, f"api_key_file: the key in {path}")
    return None


def _header_safe(key: str, where: str) -> str:
    """A key goes into an `Authorization` header: only visible ASCII can travel there (an
    inner line break would otherwise fail deep in the HTTP client, or split the header)."""
    if not all("!" <= c <= "~" for c in key):
        raise JobError(f"{where} contains a line break, space, control or non-ASCII "
                       "character, which an HTTP header cannot carry (one key, one line)")
    return key

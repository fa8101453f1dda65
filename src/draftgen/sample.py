"""The unit of work and what becomes of it.

A `Sample` is one request to make (or, with `multi_turn: all`, a short chain of requests);
it ends as a `Record` (generated turns) or a `Failure` (a typed reason). Samples are plain
frozen dataclasses: a plan holds ~10^5 of them and orjson serialises them directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Message = dict[str, str]


# Not frozen (by convention never mutated): a frozen dataclass's __init__ is ~3x slower,
# and a plan builds 10^5 of them on every start.
@dataclass(slots=True)
class Sample:
    id: str
    category: str
    partition: str
    # What is sent first: optional system message, then the conversation up to a user turn.
    messages: tuple[Message, ...]
    max_tokens: int
    # multi_turn "all": user turns appended, in order, after each generated reply.
    followups: tuple[str, ...] = ()
    seed: int | None = None
    prompt_tokens: int = 0
    source: str = ""
    fingerprint: str = ""
    # The source row's own id (its `id_field`), for exports that keep the source's ids.
    source_id: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """One generated assistant reply."""

    content: str
    reasoning: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    duration_s: float
    # The engine's own token ids, where it returns them (vLLM `return_token_ids`, SGLang
    # 0.5.23 `sglext`): what the model read and wrote, with no re-tokenisation.
    token_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    # The worker a gateway says served this turn (None: sent to the server itself).
    served_by: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    id: str
    fingerprint: str
    category: str
    partition: str
    messages: tuple[Message, ...]
    followups: tuple[str, ...]
    turns: tuple[Turn, ...]
    server: str
    attempts: int
    finished_at: float
    status: Literal["done"] = "done"
    # The server's configuration when it wrote this (engine, version, model, KV dtype, ...):
    # an id into the run manifest's `configurations`; None when it could not be verified.
    server_config: str | None = None
    # The gateway the request went through (`server` is then the worker that served it).
    gateway: str | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.turns[-1].finish_reason if self.turns else None

    @property
    def truncated(self) -> bool:
        return any(t.finish_reason == "length" for t in self.turns)

    @property
    def output_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.turns)


@dataclass(frozen=True, slots=True)
class Failure:
    id: str
    fingerprint: str
    category: str
    partition: str
    reason: str
    message: str
    attempts: int
    server: str
    finished_at: float
    status: Literal["failed"] = "failed"


@dataclass(frozen=True, slots=True)
class Rejected:
    """A source row that cannot become a sample, set aside with why."""

    category: str
    source: str
    row: int
    reason: str
    extra: dict[str, Any] = field(default_factory=dict)


def base_body(model: str, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields shared by every sample of a job (sampling minus unset values)."""
    body: dict[str, Any] = {"model": model}
    extra = dict(sampling.get("extra_body") or {})
    for k, v in sampling.items():
        if k not in ("extra_body", "seed") and v is not None:
            body[k] = v
    body.update(extra)
    return body


def request_body(
    sample: Sample, base: Mapping[str, Any], messages: list[Message]
) -> dict[str, Any]:
    body = dict(base)
    body["messages"] = messages
    body["max_tokens"] = sample.max_tokens
    if sample.seed is not None:
        body["seed"] = sample.seed
    return body


def content_digest(messages: Sequence[Message], followups: Sequence[str]) -> str:
    """A hash of the conversation a sample sends: its dedup key and a fingerprint part."""
    canonical = orjson.dumps({"messages": messages, "followups": followups},
                             option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


def body_digest(base: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(base, option=orjson.OPT_SORT_KEYS)).hexdigest()


def fingerprint(base_digest: str, content: str, max_tokens: int, seed: int | None) -> str:
    """A hash of everything that shapes the generated text; resume compares it.

    Built from digests computed once per job and once per prompt, since a plan makes 10^5.
    """
    key = f"{base_digest}:{content}:{max_tokens}:{seed}".encode()
    return hashlib.sha256(key).hexdigest()[:16]

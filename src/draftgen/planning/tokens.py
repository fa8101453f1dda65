"""Counting prompt tokens for planning: exact with a tokenizer, estimated without one.

Counts cover message text plus a fixed allowance per message for the chat template's role
markers; the template itself is not rendered, so even an "exact" count is within a few
tokens per message of what the server sees. That is close enough to route prompts to
partitions and size a run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from draftgen.errors import JobError
from draftgen.job import JobSpec
from draftgen.sample import Message

MESSAGE_OVERHEAD_TOKENS = 4
CHARS_PER_TOKEN = 4
ESTIMATE_LABEL = "estimate (chars/4)"
ENCODE_CHUNK_CHARS = 4_000_000


def _estimate(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


class TokenCounter:
    """Counts the tokens of the messages a sample sends, follow-up user turns included."""

    def __init__(self, tokenizer: Any | None = None, label: str | None = None) -> None:
        # A `tokenizers.Tokenizer`, or None to estimate from characters.
        self._tokenizer = tokenizer
        # encode_batch_fast (tokenizers >= 0.20) skips computing offsets we never read.
        self._encode: Any = getattr(tokenizer, "encode_batch_fast", None) or getattr(
            tokenizer, "encode_batch", None
        )
        self.exact = tokenizer is not None
        self.label = label or ("tokenizer" if self.exact else ESTIMATE_LABEL)
        # Why a requested tokenizer is not in use; the plan reports it.
        self.warning: str | None = None

    @classmethod
    def estimate(cls, warning: str | None = None) -> TokenCounter:
        counter = cls()
        counter.warning = warning
        return counter

    @classmethod
    def from_path(cls, path: Path, label: str | None = None) -> TokenCounter:
        """Load a tokenizer.json (or a directory holding one). A tokenizer the user named
        that cannot be loaded is a JobError: counting by estimate instead would route
        prompts to partitions and reject them by numbers nobody asked for."""
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise JobError(f"tokenizer: no tokenizer file {file}")
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(file))
        # tokenizers raises a bare Exception for unreadable or malformed files.
        except Exception as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            raise JobError(f"tokenizer: cannot load {file}: {detail}") from None
        return cls(tok, label or f"tokenizer ({file})")

    @classmethod
    def from_job(cls, job: JobSpec) -> TokenCounter:
        if job.tokenizer is None:
            return cls.estimate()
        return cls.from_path(job.resolve(job.tokenizer), f"tokenizer ({job.tokenizer})")

    def count_messages(self, messages: Iterable[Message]) -> int:
        return self.count_texts([m["content"] for m in messages])

    def count_prompt(self, messages: Iterable[Message], followups: Iterable[str] = ()) -> int:
        """Every user turn the sample will send counts, since each one grows the context."""
        return self.count_texts([*(m["content"] for m in messages), *followups])

    def count_texts(self, texts: Sequence[str]) -> int:
        """Tokens of `texts` sent as that many messages."""
        overhead = MESSAGE_OVERHEAD_TOKENS * len(texts)
        if self._tokenizer is None:
            return overhead + sum(_estimate(t) for t in texts)
        return overhead + sum(self._token_lengths(texts))

    def count_many(self, prompts: Sequence[tuple[Sequence[Message], Sequence[str]]]) -> list[int]:
        """`count_prompt` for many prompts in one batch, which tokenizers runs in parallel."""
        groups = [[*(m["content"] for m in msgs), *fups] for msgs, fups in prompts]
        if self._tokenizer is None:
            return [self.count_texts(g) for g in groups]
        flat = [t for g in groups for t in g]
        lengths = self._token_lengths(flat)
        counts, pos = [], 0
        for g in groups:
            counts.append(MESSAGE_OVERHEAD_TOKENS * len(g) + sum(lengths[pos : pos + len(g)]))
            pos += len(g)
        return counts

    def _token_lengths(self, texts: Sequence[str]) -> list[int]:
        # System prompts repeat across a whole category: encode each distinct text once.
        by_text: dict[str, int] = {}
        for chunk in _chunks(list(dict.fromkeys(texts))):
            encodings = self._encode(chunk, add_special_tokens=False)
            by_text.update(zip(chunk, (len(e) for e in encodings), strict=True))
        return [by_text[t] for t in texts]


def _chunks(texts: list[str]) -> Iterator[list[str]]:
    """Batches of about ENCODE_CHUNK_CHARS characters.

    Encodings keep several arrays per token, so 10^5 long prompts encoded in one call would
    hold gigabytes; batches this size still keep every core busy.
    """
    chunk: list[str] = []
    size = 0
    for t in texts:
        chunk.append(t)
        size += len(t)
        if size >= ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk

"""Shared system prompts: a server's prefix cache holds one copy for every request that
opens with it (vLLM's automatic prefix caching and SGLang's radix cache are on by
default), so KV use counts a shared system prompt once per server, not once per request."""

from __future__ import annotations

from collections import Counter

from draftgen.sample import Sample


class SharedPrefixes:
    def __init__(self) -> None:
        self._by_sample: dict[str, tuple[str, int]] = {}
        self._on: dict[str, Counter[str]] = {}  # server -> system prompt -> requests

    def of(self, sample: Sample) -> tuple[str, int]:
        """The sample's system prompt and its share of the prompt's tokens ("", 0: none)."""
        hit = self._by_sample.get(sample.id)
        if hit is None:
            first = sample.messages[0] if sample.messages else None
            text = first["content"] if first is not None and first["role"] == "system" else ""
            total = sum(len(m["content"]) for m in sample.messages) + sum(
                len(f) for f in sample.followups)
            hit = (text, sample.prompt_tokens * len(text) // total) if text else ("", 0)
            self._by_sample[sample.id] = hit
        return hit

    def held(self, url: str, sample: Sample) -> int:
        """Tokens of `sample`'s prompt the server already holds for requests in flight."""
        key, n = self.of(sample)
        return n if key and self._on.get(url, Counter())[key] else 0

    def add(self, url: str, sample: Sample) -> None:
        key, _ = self.of(sample)
        if key:
            self._on.setdefault(url, Counter())[key] += 1

    def remove(self, url: str, sample: Sample) -> None:
        key, _ = self._by_sample.pop(sample.id, ("", 0))
        on = self._on.get(url)
        if key and on is not None:
            on[key] -= 1
            if on[key] <= 0:
                del on[key]

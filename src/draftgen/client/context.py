"""What a server can take: its context length, and a prompt's length by its own count.

Each engine of the registry says where it publishes its context length and how its
`/tokenize` counts a chat prompt (`Engine.context_paths`, `context_in`, `count_requests`:
through the chat template where the release can, else the text plus the template's tokens);
these are asked in turn, so a URL needs no label. Where no `/tokenize` counts the template
(SGLang 0.5.9 counts text only; a gateway may have none), a one-token chat completion does:
the server reports the prompt it read in its usage, or, refusing it as too long, in its
words (`refusal_counts`) — a prefill each, for the few prompts near the limit only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from draftgen.client.classify import error_object
from draftgen.client.openai import CHAT_PATH, ChatClient
from draftgen.engines.base import CountRequest
from draftgen.engines.registry import ENGINES
from draftgen.errors import RequestError
from draftgen.sample import Message

# (context, prompt) in a server's refusal, as each engine words it.
_REFUSALS = (
    # SGLang 0.5.23: "... maximum context length of M tokens. You requested a total of T
    # tokens: N tokens from the input messages and K tokens for the completion."
    re.compile(r"maximum context length of (?P<context>\d+) tokens\. You requested a total "
               r"of \d+ tokens: (?P<prompt>\d+) tokens from the input"),
    # vLLM before 0.10: "This model's maximum context length is M tokens. However, you
    # requested T tokens (N in the messages, K in the completion)."
    re.compile(r"maximum context length is (?P<context>\d+) tokens\. However, you requested "
               r"\d+ tokens \((?P<prompt>\d+) in the messages"),
    # vLLM 0.32: "... maximum context length is M tokens. However, your prompt contains
    # [at least ]N input tokens, which exceeds this limit even without any output tokens."
    re.compile(r"maximum context length is (?P<context>\d+) tokens\. However, your prompt "
               r"contains (?:at least )?(?P<prompt>\d+) input tokens"),
    # vLLM 0.10-0.11, the prompt alone too long: "This model's maximum context length is
    # M tokens. However, your request has N input tokens."; with max_tokens: "... is too
    # large: K. This model's maximum context length is M tokens and your request has N
    # input tokens (...)".
    re.compile(r"maximum context length is (?P<context>\d+) tokens(?:\. However,| and) your "
               r"request has (?P<prompt>\d+) input tokens"),
    # vLLM V0: "The decoder prompt (length N) is longer than the maximum model length of M."
    re.compile(r"decoder prompt \(length (?P<prompt>\d+)\) is longer than the maximum model "
               r"length of (?P<context>\d+)"),
    # vLLM 0.32 (where the prompt alone is too long; it clamps max_tokens itself otherwise):
    # "Input length (N) exceeds model's maximum context length (M)."
    re.compile(r"Input length \((?P<prompt>\d+)\) exceeds model's maximum context length "
               r"\((?P<context>\d+)\)"),
    # SGLang, over its max_req_input_len: "Input length (N tokens) exceeds the maximum
    # allowed length (M tokens)."
    re.compile(r"Input length \((?P<prompt>\d+) tokens\) exceeds the maximum allowed length "
               r"\((?P<context>\d+) tokens\)"),
    # SGLang: "The input (N tokens) is longer than the model's context length (M tokens)."
    re.compile(r"input \((?P<prompt>\d+) tokens\) is longer than the model's context "
               r"length \((?P<context>\d+) tokens\)"),
)


class Refused(NamedTuple):
    context: int
    prompt: int  # the prompt's tokens, by the server's count


def refusal_counts(message: str) -> Refused | None:
    """The context and prompt length a server's "context length exceeded" message gives;
    None where it says neither."""
    for pattern in _REFUSALS:
        if found := pattern.search(message):
            return Refused(int(found["context"]), int(found["prompt"]))
    return None


async def context_length(client: ChatClient, url: str, *, timeout_s: float = 10.0) -> int | None:
    """The server's context length; None when it answers without saying. Raises the
    first `RequestError` when no endpoint answers at all (down, or silent)."""
    first: RequestError | None = None
    answered = False
    paths = dict.fromkeys(p for e in ENGINES.values() for p in e.context_paths)
    for path in paths:
        try:
            status, obj = await client.fetch_json(url, path, timeout_s=timeout_s)
        except RequestError as e:
            first = first or e
            continue
        answered = True
        if status != 200:
            continue
        for engine in ENGINES.values():
            if path in engine.context_paths and (found := engine.context_in(obj)):
                return found
    if first is not None and not answered:
        raise first
    return None


async def prompt_tokens(client: ChatClient, url: str, model: str,
                        messages: Sequence[Message], *, timeout_s: float = 30.0) -> int | None:
    """How many tokens the server reads for `messages` (its template and generation prompt
    included); None when it cannot say. Raises `RequestError` where only a one-token
    completion could count and it failed (a timeout, the server down)."""
    asks: list[CountRequest] = []
    for engine in ENGINES.values():
        asks += [r for r in engine.count_requests(model, messages) if r not in asks]
    estimate: int | None = None
    for ask in asks:
        status, obj = await client.fetch_json(url, "/tokenize", ask.body, timeout_s=timeout_s)
        if status == 200 and isinstance(obj, dict) and isinstance(obj.get("count"), int):
            if not ask.added_tokens:
                return int(obj["count"])
            estimate = int(obj["count"]) + ask.added_tokens
            break
        if status not in (400, 422):
            break
    try:
        exact = await one_token_count(client, url, model, messages, timeout_s=timeout_s)
    except RequestError:
        if estimate is None:
            raise
        exact = None
    return exact if exact is not None else estimate


async def one_token_count(client: ChatClient, url: str, model: str,
                          messages: Sequence[Message], *, timeout_s: float) -> int | None:
    """The prompt tokens a one-token chat completion of `messages` reports (its usage, or
    its refusal's words: over the context, possibly only a bound, as vLLM's "at least
    4097"); None when it says neither."""
    body = {"model": model, "messages": list(messages), "max_tokens": 1, "temperature": 0}
    status, obj = await client.fetch_json(url, CHAT_PATH, body, timeout_s=timeout_s)
    if status == 200 and isinstance(obj, dict):
        usage = obj.get("usage")
        n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return n if isinstance(n, int) and n > 0 else None
    error = error_object(obj) if isinstance(obj, dict) else None
    message = error.get("message") if error is not None else None
    if isinstance(message, str) and (refused := refusal_counts(message)):
        return refused.prompt
    return None

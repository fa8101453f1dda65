"""What a server can take: its context length, and a prompt's length by its own count.

Each engine of the registry says where it publishes its context length and how its
`/tokenize` counts a chat prompt (`Engine.context_paths`, `context_in`, `count_requests`:
through the chat template where the release can, else the text plus the template's tokens);
these are asked in turn, so a URL needs no label.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftgen.client.openai import ChatClient
from draftgen.errors import RequestError
from draftgen.sample import Message
from draftgen.servers.engines.base import CountRequest
from draftgen.servers.engines.registry import ENGINES


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
    included); None when it cannot say (no /tokenize)."""
    asks: list[CountRequest] = []
    for engine in ENGINES.values():
        asks += [r for r in engine.count_requests(model, messages) if r not in asks]
    for ask in asks:
        status, obj = await client.fetch_json(url, "/tokenize", ask.body, timeout_s=timeout_s)
        if status == 200 and isinstance(obj, dict) and isinstance(obj.get("count"), int):
            return int(obj["count"]) + ask.added_tokens
        if status not in (400, 422):
            return None
    return None

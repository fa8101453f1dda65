"""What a server can take: its context length, and a prompt's length by its own count.

vLLM and SGLang list `max_model_len` in /v1/models; older SGLang has `context_length` in
/server_info. Both count a prompt at /tokenize: vLLM and SGLang 0.5.23 through the chat
template (`messages`, the exact number the server will see), SGLang 0.5.9 only for plain
text (`prompt`), to which the template's few tokens per message are added.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftgen.client.openai import ChatClient
from draftgen.errors import RequestError
from draftgen.sample import Message

# The chat template's role markers per message, where the server counts text only.
TEMPLATE_TOKENS_PER_MESSAGE = 8


async def context_length(client: ChatClient, url: str, *, timeout_s: float = 10.0) -> int | None:
    """The server's context length; None when it answers without saying. Raises the
    first `RequestError` when neither endpoint answers at all (down, or silent)."""
    first: RequestError | None = None
    answered = False
    for path in ("/v1/models", "/server_info"):
        try:
            status, obj = await client.fetch_json(url, path, timeout_s=timeout_s)
        except RequestError as e:
            first = first or e
            continue
        answered = True
        if status == 200 and (found := _context_in(obj)):
            return found
    if first is not None and not answered:
        raise first
    return None


async def prompt_tokens(client: ChatClient, url: str, model: str,
                        messages: Sequence[Message], *, timeout_s: float = 30.0) -> int | None:
    """How many tokens the server reads for `messages` (its template and generation prompt
    included); None when it cannot say (no /tokenize)."""
    # No `add_generation_prompt`: vLLM adds it by default, and SGLang 0.5.23 renders
    # messages as for a chat completion only when it is left out.
    body: dict[str, Any] = {"model": model, "messages": list(messages)}
    status, obj = await client.fetch_json(url, "/tokenize", body, timeout_s=timeout_s)
    if status == 200 and isinstance(obj, dict) and isinstance(obj.get("count"), int):
        return int(obj["count"])
    if status not in (400, 422):
        return None
    # SGLang 0.5.9 takes text only.
    text = "\n".join(m["content"] for m in messages)
    status, obj = await client.fetch_json(url, "/tokenize", {"model": model, "prompt": text,
                                                             "add_special_tokens": False},
                                          timeout_s=timeout_s)
    if status == 200 and isinstance(obj, dict) and isinstance(obj.get("count"), int):
        return int(obj["count"]) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages)
    return None


def _context_in(obj: Any) -> int | None:
    if not isinstance(obj, dict):
        return None
    data = obj.get("data")
    if isinstance(data, list) and data and isinstance(data[0], dict):
        value = data[0].get("max_model_len")
    else:
        value = obj.get("context_length") or obj.get("max_req_input_len")
    return value if isinstance(value, int) and value > 0 else None

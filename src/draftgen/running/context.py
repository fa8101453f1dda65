"""How much answer fits a request, turn by turn: what the plan's count cannot know.

The plan fits each sample's first request to the context (`running/startup.py`). A later
turn of a multi-turn sample carries every answer so far; its prompt is reckoned here from
what the server counted of the turn before (its prompt and its answer, from the usage it
reports) plus the new user turn (characters / 3, a token rarely being shorter, plus the
template's role markers). A server that refuses a request as too long says how long the
prompt was in its own words (SGLang, older vLLM): the room left is read from them.
"""

from __future__ import annotations

import math
from typing import Protocol

from draftgen.client.context import refusal_counts

# A shorter answer than this is no answer worth sending.
MIN_ANSWER_TOKENS = 16
# The chat template's markers around the assistant turn just ended and the new user turn.
TEMPLATE_TOKENS = 16
CHARS_PER_TOKEN_AT_MOST = 3

class _Counted(Protocol):
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...


def later_turn_room(previous: _Counted, user_text: str, context: int | None) -> int | None:
    """Tokens of answer the next turn has room for; None when that cannot be reckoned
    (no context known, or the server reported no usage)."""
    if context is None or not previous.prompt_tokens or previous.completion_tokens is None:
        return None  # a server that reports no usage: nothing to reckon from
    prompt = (previous.prompt_tokens + previous.completion_tokens + TEMPLATE_TOKENS
              + math.ceil(len(user_text) / CHARS_PER_TOKEN_AT_MOST))
    return context - prompt


def room_after_refusal(message: str, context: int | None) -> int | None:
    """The answer that fits, from a server's "context length exceeded" message; None
    where it does not say, or where not even a short answer fits."""
    refused = refusal_counts(message)
    if refused is None:
        return None
    limit = refused.context if context is None else min(context, refused.context)
    room = limit - refused.prompt
    return room if room >= MIN_ANSWER_TOKENS else None

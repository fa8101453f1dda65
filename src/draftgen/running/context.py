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
import re
from typing import Protocol

# A shorter answer than this is no answer worth sending.
MIN_ANSWER_TOKENS = 16
# The chat template's markers around the assistant turn just ended and the new user turn.
TEMPLATE_TOKENS = 16
CHARS_PER_TOKEN_AT_MOST = 3

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
    # vLLM 0.32 (where the prompt alone is too long; it clamps max_tokens itself otherwise):
    # "Input length (N) exceeds model's maximum context length (M)."
    re.compile(r"Input length \((?P<prompt>\d+)\) exceeds model's maximum context length "
               r"\((?P<context>\d+)\)"),
    # SGLang: "The input (N tokens) is longer than the model's context length (M tokens)."
    re.compile(r"input \((?P<prompt>\d+) tokens\) is longer than the model's context "
               r"length \((?P<context>\d+) tokens\)"),
)


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
    for pattern in _REFUSALS:
        found = pattern.search(message)
        if found:
            limit = int(found["context"]) if context is None else min(context,
                                                                       int(found["context"]))
            room = limit - int(found["prompt"])
            return room if room >= MIN_ANSWER_TOKENS else None
    return None

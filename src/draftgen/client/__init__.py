"""The HTTP boundary: streaming chat completions and the typed errors they can end in."""

from draftgen.client.classify import classify_status, classify_stream_error, says_context_too_long
from draftgen.client.openai import ChatClient, Completion

__all__ = [
    "ChatClient",
    "Completion",
    "classify_status",
    "classify_stream_error",
    "says_context_too_long",
]

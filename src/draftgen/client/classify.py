"""HTTP status and server error bodies → one typed `RequestError`.

This is where retry behaviour is decided: `Transient` (and its `ServerDown`) may be sent
again, `Permanent` ones may not. Messages carry the status and at most `EXCERPT_CHARS`
characters of what the server said, and never the API key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from draftgen.errors import (
    BadRequest,
    ContextTooLong,
    RequestError,
    RunError,
    ServerDown,
    Transient,
)
from draftgen.errors import redact as redact_secrets

EXCERPT_CHARS = 300

# Lower-case fragments of "prompt + max_tokens do not fit" across engine versions:
#   vLLM:   "This model's maximum context length is 4096 tokens. However, you requested ..."
#           "'max_tokens' or 'max_completion_tokens' is too large: ... maximum context length ..."
#           "The decoder prompt (length 9254) is longer than the maximum model length of 4096.
#            Make sure that `max_model_len` is no smaller than ..."
#   SGLang: "The input (N tokens) is longer than the model's context length (M tokens)."
#           "Requested token count exceeds the model's maximum context length of M tokens."
#           "Input length (N tokens) exceeds the maximum allowed length (M tokens). Use a
#            shorter input or enable --allow-auto-truncate."
#   OpenAI-style gateways: code "context_length_exceeded".
_CONTEXT_PHRASES = (
    "context length",
    "context_length_exceeded",
    "context window",
    "maximum model length",
    "max_model_len",
    "exceeds the maximum allowed length",
    "allow-auto-truncate",
    "max_total_tokens",
    "max_total_num_tokens",
    "prompt is too long",
    "input is too long",
)

_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def says_context_too_long(text: str) -> bool:
    lowered = text.lower()
    return any(phrase in lowered for phrase in _CONTEXT_PHRASES)


def _says_no_such_model(text: str) -> bool:
    # vLLM: "The model `x` does not exist."; SGLang and gateways: "model ... not found".
    lowered = text.lower()
    return "model" in lowered and ("does not exist" in lowered or "not found" in lowered)


def redact(text: str, secret: str | None) -> str:
    """The text with the key, and any other in a spot that shows one (`Bearer K`)."""
    return redact_secrets(text, (secret,))


def excerpt(body: bytes | str, *, secret: str | None = None) -> str:
    """What the server said, short: the JSON error message if there is one, else the raw text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    message = _json_error_message(text)
    if message is not None:
        text = message
    # Redact before cutting, so a key straddling the cut cannot survive in part.
    text = " ".join(redact(text, secret).split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…"


def _json_error_message(text: str) -> str | None:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    err = error_object(obj)
    if err is None:
        # FastAPI's HTTPException body.
        detail = obj.get("detail")
        return detail if isinstance(detail, str) else None
    message = err.get("message")
    return message if isinstance(message, str) else None


def error_object(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The error inside a server's JSON, in either shape engines use, or None.

    Newer vLLM and SGLang stream `{"error": {"message", "type", "code"}}`; older vLLM
    and SGLang's HTTP error bodies put the fields at the top with `"object": "error"`.
    """
    err = obj.get("error")
    if isinstance(err, Mapping):
        return err
    if isinstance(err, str):
        return {"message": err}
    if obj.get("object") == "error":
        return obj
    return None


def classify_status(status: int, body: bytes | str, *, secret: str | None = None) -> RequestError:
    """The error for a non-2xx HTTP response."""
    label = f"HTTP {status} {_REASONS.get(status, '')}".rstrip()
    if status in (401, 403):
        # Servers echo keys back ("Incorrect API key provided: sk-ab***yz"), so the body is
        # left out entirely rather than trusted to be free of a key fragment.
        return RunError(f"{label}: the server refused the API key", status=status)
    text = excerpt(body, secret=secret)
    message = f"{label}: {text}" if text else label
    if status in (502, 503):
        return ServerDown(message, status=status)
    if status in (408, 429) or status >= 500:
        if status == 500 and says_context_too_long(text):
            return ContextTooLong(message, status=status)
        return Transient(message, status=status)
    if status == 404 or (400 <= status < 500 and _says_no_such_model(text)):
        return RunError(f"{message} (no such model or chat endpoint at this URL)",
                        status=status)
    if 400 <= status < 500:
        if says_context_too_long(text):
            return ContextTooLong(message, status=status)
        return BadRequest(message, status=status)
    # 1xx/3xx: redirects are not followed on purpose, a POST must reach the engine itself.
    return BadRequest(f"unexpected {message}", status=status)


def classify_stream_error(err: Mapping[str, Any], *, secret: str | None = None) -> RequestError:
    """The error for an error object sent inside an SSE stream after HTTP 200.

    Engines put the HTTP status they would have sent in `code`; a string code
    (OpenAI style, e.g. "context_length_exceeded") is only a hint. Without a status the
    stream broke for a reason the server did not name, so another try may help.
    """
    raw_message = err.get("message")
    message = raw_message if isinstance(raw_message, str) else orjson.dumps(err).decode()
    code = err.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        classified = classify_status(code, message, secret=secret)
        return type(classified)(f"error in stream: {classified}", status=code)
    text = excerpt(message, secret=secret)
    hint = f"{code} " if isinstance(code, str) else ""
    if says_context_too_long(f"{hint}{text}"):
        return ContextTooLong(f"error in stream: {hint}{text}")
    return Transient(f"error in stream: {hint}{text}")

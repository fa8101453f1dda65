"""Status codes and engine error messages → the right error class, with a safe message."""

from __future__ import annotations

import orjson
import pytest

from draftgen.client.classify import (
    EXCERPT_CHARS,
    classify_status,
    classify_stream_error,
    excerpt,
    says_context_too_long,
)
from draftgen.errors import (
    BadRequest,
    ContextTooLong,
    RequestError,
    RunError,
    ServerDown,
    Transient,
)

KEY = "sk-live-0123456789abcdef"

# Messages as vLLM and SGLang word them (several versions of each).
CONTEXT_MESSAGES = [
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(1000 in the messages, 4000 in the completion). Please reduce the length of the messages "
    "or completion.",
    "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum context "
    "length is 4096 tokens and your request has 1000 input tokens (4000 > 4096 - 1000).",
    "The decoder prompt (length 9254) is longer than the maximum model length of 4096. Make "
    "sure that `max_model_len` is no smaller than the number of text tokens.",
    "The input (150000 tokens) is longer than the model's context length (131072 tokens).",
    "Requested token count exceeds the model's maximum context length of 32768 tokens. You "
    "requested a total of 40000 tokens.",
    "Input length (31996 tokens) exceeds the maximum allowed length (31994 tokens). Use a "
    "shorter input or enable --allow-auto-truncate.",
]

OTHER_MESSAGES = [
    "temperature must be non-negative, got -1.0",
    "1 validation error for ChatCompletionRequest messages Field required",
]


def _body(message: str, status: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}})


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (502, ServerDown),
        (503, ServerDown),
        (408, Transient),
        (429, Transient),
        (500, Transient),
        (504, Transient),
        (507, Transient),
        (400, BadRequest),
        # Run-level: every sample would fail alike (key, model, endpoint).
        (404, RunError),
        (413, BadRequest),
        (422, BadRequest),
        (401, RunError),
        (403, RunError),
        (302, BadRequest),
    ],
)
def test_status_decides_the_class(status: int, kind: type[RequestError]) -> None:
    err = classify_status(status, b"some body")
    assert type(err) is kind
    assert err.status == status
    assert f"HTTP {status}" in str(err)


def test_retryable_follows_the_class() -> None:
    assert classify_status(503, b"").retryable
    assert classify_status(429, b"").retryable
    assert not classify_status(400, b"").retryable
    assert not classify_status(400, _body(CONTEXT_MESSAGES[0], 400)).retryable


@pytest.mark.parametrize("message", CONTEXT_MESSAGES)
@pytest.mark.parametrize("status", [400, 413, 422])
def test_context_overflow_messages(message: str, status: int) -> None:
    err = classify_status(status, _body(message, status))
    assert isinstance(err, ContextTooLong)


@pytest.mark.parametrize("message", OTHER_MESSAGES)
def test_other_client_errors_stay_bad_request(message: str) -> None:
    assert type(classify_status(400, _body(message, 400))) is BadRequest
    assert not says_context_too_long(message)


def test_context_overflow_reported_as_500_is_still_permanent() -> None:
    assert isinstance(classify_status(500, _body(CONTEXT_MESSAGES[0], 500)), ContextTooLong)


def test_gateway_errors_are_not_read_as_context_errors() -> None:
    # A proxy page for a dead upstream must stay ServerDown whatever it says.
    assert type(classify_status(502, b"<html>context length</html>")) is ServerDown


@pytest.mark.parametrize("status", [401, 403])
def test_auth_errors_leave_out_the_body(status: int) -> None:
    err = classify_status(status, f"Incorrect API key provided: {KEY[:8]}***{KEY[-4:]}")
    assert KEY[:8] not in str(err) and KEY[-4:] not in str(err)
    assert "API key" in str(err)


def test_key_is_redacted_before_the_excerpt_is_cut() -> None:
    body = "x" * (EXCERPT_CHARS - 5) + KEY
    text = excerpt(body, secret=KEY)
    assert KEY[:5] not in text


def test_excerpt_is_short_and_single_line() -> None:
    text = excerpt(b"<html>\n" + b"bad gateway " * 100 + b"\n</html>")
    assert len(text) <= EXCERPT_CHARS
    assert "\n" not in text


@pytest.mark.parametrize(
    "body",
    [
        b'{"error": {"message": "boom", "code": 400}}',
        b'{"object": "error", "message": "boom", "type": "BadRequestError", "code": 400}',
        b'{"detail": "boom"}',
        b'{"error": "boom"}',
    ],
)
def test_excerpt_prefers_the_json_message(body: bytes) -> None:
    assert excerpt(body) == "boom"


def test_excerpt_of_undecodable_bytes() -> None:
    assert excerpt(b"\xff\xfe oops") == "\ufffd\ufffd oops"


@pytest.mark.parametrize(
    ("err", "kind", "status"),
    [
        ({"message": "boom", "code": 500}, Transient, 500),
        ({"message": "overloaded", "code": 503}, ServerDown, 503),
        ({"message": "bad grammar", "code": 400}, BadRequest, 400),
        ({"message": "bad grammar", "code": "400"}, BadRequest, 400),
        ({"message": CONTEXT_MESSAGES[3], "code": 400}, ContextTooLong, 400),
        ({"message": "too long", "code": "context_length_exceeded"}, ContextTooLong, None),
        ({"message": "engine dead"}, Transient, None),
        ({"type": "weird"}, Transient, None),
    ],
)
def test_stream_error_objects(
    err: dict[str, object], kind: type[RequestError], status: int | None
) -> None:
    classified = classify_stream_error(err)
    assert type(classified) is kind
    assert classified.status == status
    assert str(classified).startswith("error in stream")


def test_stream_error_redacts_key() -> None:
    err = classify_stream_error({"message": f"header Bearer {KEY}", "code": 400}, secret=KEY)
    assert KEY not in str(err)


@pytest.mark.parametrize("message", ["The model `gpt-4` does not exist.",
                                     "Model 'kimi' not found"])
def test_a_model_the_server_lacks_concerns_the_whole_run(message: str) -> None:
    assert type(classify_status(400, _body(message, 400))) is RunError

"""ChatClient against a scripted local server: what it sends, what it returns, how it fails."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import orjson
import pytest

from draftgen.client import ChatClient
from draftgen.client.sse import SSEDecoder
from draftgen.clock import FakeClock
from draftgen.errors import (
    BadRequest,
    ContextTooLong,
    Permanent,
    RequestError,
    RunError,
    ServerDown,
    Transient,
)
from helpers.fakeserver import (
    DISCONNECT,
    DONE,
    STALL,
    FakeServer,
    Reply,
    chunk,
    completion,
    error_reply,
    sse,
    usage,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
KEY = "sk-secret-key-1234567890"


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    async with FakeServer() as srv:
        yield srv


class TickClock(FakeClock):
    """Each reading is one second after the last, so timings count clock readings."""

    def monotonic(self) -> float:
        now = super().monotonic()
        self.advance(1.0)
        return now


# --- the happy path ------------------------------------------------------------------


async def test_streams_content_usage_and_finish_reason(server: FakeServer) -> None:
    server.script(completion(["Hel", "lo", " world"], prompt_tokens=11, completion_tokens=3))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.content == "Hello world"
    assert result.reasoning is None
    assert result.finish_reason == "stop"
    assert (result.prompt_tokens, result.completion_tokens) == (11, 3)


async def test_sends_body_with_streaming_usage_and_bearer_key(server: FakeServer) -> None:
    server.script(completion(["x"]))
    body = {**BODY, "stream_options": {"continuous_usage_stats": False}}
    async with ChatClient(api_key=KEY) as client:
        await client.chat(server.url + "/", body)
    seen = server.seen[0]
    assert seen.body == {
        **BODY,
        "stream": True,
        "stream_options": {"continuous_usage_stats": False, "include_usage": True},
    }
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
    assert seen.headers["Content-Type"] == "application/json"
    assert "stream" not in body  # the caller's dict is not modified


async def test_no_authorization_header_without_key(server: FakeServer) -> None:
    server.script(completion(["x"]))
    async with ChatClient() as client:
        await client.chat(server.url + "/v1", BODY)
    assert "Authorization" not in server.seen[0].headers


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
async def test_collects_reasoning_under_either_name(server: FakeServer, key: str) -> None:
    steps = [
        chunk(reasoning="think ", reasoning_key=key),
        chunk(reasoning="more", reasoning_key=key),
        chunk("answer"),
        chunk(finish="stop"),
        DONE,
    ]
    server.script(Reply(steps=steps))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.reasoning == "think more"
    assert result.content == "answer"
    assert result.completion_tokens == 0  # no usage chunk: nothing is guessed


async def test_on_token_counts_one_token_per_chunk_without_usage(server: FakeServer) -> None:
    steps = [
        chunk("", role="assistant"),
        chunk(reasoning="r"),
        chunk("a"),
        chunk("b", finish="stop"),
        usage(1, 3),
        DONE,
    ]
    server.script(Reply(steps=steps))
    calls: list[int] = []
    async with ChatClient() as client:
        await client.chat(server.url, BODY, on_token=calls.append)
    assert calls == [1, 2, 3]
    options = server.seen[-1].body["stream_options"]
    assert options == {"continuous_usage_stats": True, "include_usage": True}


async def test_on_token_follows_the_usage_in_each_chunk(server: FakeServer) -> None:
    # A server that fell behind its reader packs several tokens into one chunk; with
    # continuous usage stats each chunk says how many the reply has so far.
    def counted(text: str, n: int) -> bytes:
        event = orjson.loads(chunk(text).removeprefix(b"data: "))
        event["usage"] = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
        return b"data: " + orjson.dumps(event) + b"\n\n"

    server.script(Reply(steps=[counted("a", 1), counted("bcd", 4), counted("e", 5),
                               usage(4, 5), DONE]))
    calls: list[int] = []
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY, on_token=calls.append)
    assert calls == [1, 4, 5]
    assert result.completion_tokens == 5


async def test_ttft_and_duration_come_from_the_injected_clock(server: FakeServer) -> None:
    # Readings: start (t=0), first text chunk (t=1), end (t=2). Role-only chunks
    # and later text chunks take no reading.
    server.script(completion(["a", "b", "c"]))
    async with ChatClient(clock=TickClock()) as client:
        result = await client.chat(server.url, BODY)
    assert result.ttft_s == 1.0
    assert result.duration_s == 2.0


async def test_no_text_means_no_ttft(server: FakeServer) -> None:
    server.script(completion([], finish="length"))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.ttft_s is None
    assert result.content == ""
    assert result.finish_reason == "length"


async def test_events_split_across_writes_and_crlf_lines(server: FakeServer) -> None:
    whole = chunk("héllo") + chunk(finish="stop")
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    steps: list[bytes | float] = []
    for piece in pieces:
        steps += [piece, 0.001]
    steps += [b": keep-alive comment\r\n\r\n", b"event: x\ndata: [DONE]\r\n\r\n"]
    server.script(Reply(steps=steps))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.content == "héllo"


async def test_finish_reason_without_done_is_complete(server: FakeServer) -> None:
    server.script(Reply(steps=[chunk("x"), chunk(finish="length"), usage(2, 1)]))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert (result.content, result.finish_reason, result.completion_tokens) == ("x", "length", 1)


async def test_non_streaming_json_answer_is_accepted(server: FakeServer) -> None:
    body = (
        b'{"choices":[{"message":{"role":"assistant","content":"hi","reasoning":"hm"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":2}}'
    )
    server.script(Reply(body=body))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert (result.content, result.reasoning, result.completion_tokens) == ("hi", "hm", 2)


# --- the session ---------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(server: FakeServer) -> None:
    server.script(completion(["a"]), completion(["b"]), completion(["c"]))
    async with ChatClient() as client:
        for _ in range(3):
            await client.chat(server.url, BODY)
    assert len({seen.peer_port for seen in server.seen}) == 1


async def test_connection_is_reused_when_the_body_end_arrives_after_done(
    server: FakeServer,
) -> None:
    # uvicorn writes the chunked-body terminator after [DONE], often in its own packet.
    late_end = Reply(steps=[chunk("a", finish="stop"), DONE, 0.05])
    server.script(late_end, late_end)
    async with ChatClient() as client:
        for _ in range(2):
            await client.chat(server.url, BODY)
    assert server.seen[0].peer_port == server.seen[1].peer_port


async def test_max_connections_bounds_requests_in_flight(server: FakeServer) -> None:
    server.script(*[Reply(steps=[chunk("x"), 0.02, chunk(finish="stop"), DONE])] * 4)
    async with ChatClient(max_connections=1) as client:
        await asyncio.gather(*(client.chat(server.url, BODY) for _ in range(4)))
    assert len(server.seen) == 4
    assert server.max_active == 1


async def test_chat_outside_the_context_is_an_error() -> None:
    client = ChatClient()
    with pytest.raises(RuntimeError, match="async with"):
        await client.chat("http://127.0.0.1:1", BODY)


# --- HTTP status → typed error -------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [(502, ServerDown), (503, ServerDown), (429, Transient), (500, Transient), (504, Transient)],
)
async def test_retryable_statuses(
    server: FakeServer, status: int, kind: type[RequestError]
) -> None:
    server.script(error_reply(status, "busy"))
    async with ChatClient() as client:
        with pytest.raises(kind) as info:
            await client.chat(server.url, BODY)
    assert info.value.status == status
    assert str(status) in str(info.value) and "busy" in str(info.value)


async def test_bad_request_is_permanent_with_server_message(server: FakeServer) -> None:
    server.script(error_reply(400, "temperature must be >= 0", nested=False))
    async with ChatClient() as client:
        with pytest.raises(BadRequest, match=r"HTTP 400.*temperature must be >= 0"):
            await client.chat(server.url, BODY)


async def test_context_overflow_is_its_own_error(server: FakeServer) -> None:
    message = (
        "This model's maximum context length is 4096 tokens. However, you requested "
        "5000 tokens (100 in the messages, 4900 in the completion)."
    )
    server.script(error_reply(400, message))
    async with ChatClient() as client:
        with pytest.raises(ContextTooLong) as info:
            await client.chat(server.url, BODY)
    assert info.value.retryable is False


async def test_rejected_key_never_appears_in_the_error(server: FakeServer) -> None:
    server.script(error_reply(401, f"Incorrect API key provided: {KEY}"))
    async with ChatClient(api_key=KEY) as client:
        with pytest.raises(RunError) as info:
            await client.chat(server.url, BODY)
    assert info.value.status == 401
    assert KEY not in str(info.value) and KEY[:10] not in str(info.value)


async def test_echoed_key_is_redacted_from_other_errors(server: FakeServer) -> None:
    server.script(error_reply(400, f"bad header Bearer {KEY}"))
    async with ChatClient(api_key=KEY) as client:
        with pytest.raises(BadRequest) as info:
            await client.chat(server.url, BODY)
    assert KEY not in str(info.value)


# --- connection failures -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_connection_refused_is_server_down() -> None:
    async with ChatClient() as client:
        with pytest.raises(ServerDown, match="cannot reach"):
            await client.chat(f"http://127.0.0.1:{_free_port()}", BODY)


async def test_disconnect_before_response_is_server_down(server: FakeServer) -> None:
    server.script(Reply(disconnect_first=True))
    async with ChatClient() as client:
        with pytest.raises(ServerDown):
            await client.chat(server.url, BODY)


async def test_disconnect_mid_stream_is_transient_not_server_down(server: FakeServer) -> None:
    server.script(Reply(steps=[chunk("partial"), DISCONNECT]))
    async with ChatClient() as client:
        with pytest.raises(Transient, match="stream broken") as info:
            await client.chat(server.url, BODY)
    assert not isinstance(info.value, ServerDown)


async def test_stream_that_ends_without_finish_is_transient(server: FakeServer) -> None:
    server.script(Reply(steps=[chunk("a"), chunk("b")]))
    async with ChatClient() as client:
        with pytest.raises(Transient, match="ended early"):
            await client.chat(server.url, BODY)


@pytest.mark.parametrize(
    "bad",
    [b"data: {not json\n\n", b"data: [1, 2]\n\n", b'data: {"choices": {"a": 1}}\n\n'],
)
async def test_malformed_chunk_is_transient(server: FakeServer, bad: bytes) -> None:
    server.script(Reply(steps=[chunk("a"), bad, chunk(finish="stop"), DONE]))
    async with ChatClient() as client:
        with pytest.raises(Transient, match="malformed stream chunk"):
            await client.chat(server.url, BODY)


async def test_server_abort_finish_reason_is_transient(server: FakeServer) -> None:
    server.script(Reply(steps=[chunk("a"), chunk(finish="abort"), DONE]))
    async with ChatClient() as client:
        with pytest.raises(Transient, match="aborted"):
            await client.chat(server.url, BODY)


# --- errors sent inside the stream ---------------------------------------------------


async def test_stream_error_with_context_message_is_context_too_long(server: FakeServer) -> None:
    # SGLang's scheduler-side validation, streamed after HTTP 200.
    err = {
        "object": "error",
        "message": "Input length (9000 tokens) exceeds the maximum allowed length "
        "(8192 tokens). Use a shorter input or enable --allow-auto-truncate.",
        "type": "BAD_REQUEST",
        "param": None,
        "code": 400,
    }
    server.script(Reply(steps=[chunk("", role="assistant"), sse({"error": err}), DONE]))
    async with ChatClient() as client:
        with pytest.raises(ContextTooLong, match="error in stream"):
            await client.chat(server.url, BODY)


async def test_stream_error_with_500_is_transient(server: FakeServer) -> None:
    err = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
    server.script(Reply(steps=[chunk("a"), sse({"error": err}), DONE]))
    async with ChatClient() as client:
        with pytest.raises(Transient) as info:
            await client.chat(server.url, BODY)
    assert info.value.status == 500


async def test_stream_error_with_400_is_permanent(server: FakeServer) -> None:
    err = {"message": "invalid grammar", "type": "BadRequestError", "code": 400}
    server.script(Reply(steps=[sse({"error": err}), DONE]))
    async with ChatClient() as client:
        with pytest.raises(Permanent, match="invalid grammar"):
            await client.chat(server.url, BODY)


# --- the idle timeout ----------------------------------------------------------------


async def test_stalled_stream_raises_after_idle_timeout(server: FakeServer) -> None:
    server.script(Reply(steps=[chunk("a"), STALL]))
    async with ChatClient(idle_timeout_s=0.3) as client:
        with pytest.raises(Transient, match=r"stream stalled: no data for 0.3s") as info:
            await client.chat(server.url, BODY)
    assert not isinstance(info.value, ServerDown)


async def test_no_response_headers_raises_after_idle_timeout(server: FakeServer) -> None:
    server.script(Reply(stall_first=True))
    async with ChatClient(idle_timeout_s=0.3) as client:
        with pytest.raises(Transient, match="no response") as info:
            await client.chat(server.url, BODY)
    assert not isinstance(info.value, ServerDown)


async def test_idle_timeout_is_not_a_total_timeout(server: FakeServer) -> None:
    # Twelve gaps of 0.05 s: 0.6 s in all, twice the idle timeout, never idle for long.
    steps: list[bytes | float] = []
    for i in range(12):
        steps += [chunk(str(i % 10)), 0.05]
    steps += [chunk(finish="stop"), DONE]
    server.script(Reply(steps=steps))
    async with ChatClient(idle_timeout_s=0.3) as client:
        result = await client.chat(server.url, BODY)
    assert result.content == "012345678901"


# --- SSE decoding --------------------------------------------------------------------


def test_sse_decoder_reassembles_lines_split_anywhere() -> None:
    stream = b'data: {"a":1}\n\n: comment\nid: 3\ndata:{"b":2}\r\n\r\ndata: [DONE]\n\n'
    for cut in range(len(stream) + 1):
        decoder = SSEDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) + decoder.close()
        assert got == [b'{"a":1}', b'{"b":2}', b"[DONE]"], cut


def test_sse_decoder_keeps_a_last_line_without_newline() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.close() == [b"[DONE]"]


# --- token ids from the server ---------------------------------------------------------


def vllm_chunk(content: str, ids: list[int], **extra: object) -> bytes:
    """vLLM's shape with `return_token_ids`: the step's ids on the choice."""
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": extra.pop(
        "finish", None), "token_ids": ids}
    return sse({"id": "c", "object": "chat.completion.chunk", "choices": [choice], **extra})


async def test_vllm_token_ids_are_collected_from_every_chunk(server: FakeServer) -> None:
    steps = [vllm_chunk("He", [5], prompt_token_ids=[1, 2, 3]), vllm_chunk("llo", [6, 7]),
             vllm_chunk("", [2], finish="stop"), usage(3, 4), DONE]
    server.script(Reply(steps=steps))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.prompt_token_ids == (1, 2, 3)
    assert result.token_ids == (5, 6, 7, 2)  # the end token the model emitted included
    assert result.content == "Hello"


async def test_sglang_ids_come_in_a_chunk_of_their_own(server: FakeServer) -> None:
    # SGLang 0.5.23 with return_*_ids_in_sglext: choices empty, ids per choice in sglext.
    ids_chunk = sse({"id": "c", "object": "chat.completion.chunk", "choices": [],
                     "sglext": {"input_ids": [9, 8], "output_ids": [[4, 5, 6]]}})
    server.script(Reply(steps=[chunk("abc"), chunk(finish="stop"), ids_chunk, usage(2, 3), DONE]))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert (result.prompt_token_ids, result.token_ids) == ((9, 8), (4, 5, 6))
    assert result.content == "abc"


async def test_no_ids_without_an_id_channel(server: FakeServer) -> None:
    server.script(completion(["x"]))
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.token_ids is None and result.prompt_token_ids is None


async def test_malformed_token_ids_are_dropped_and_the_answer_kept(server: FakeServer) -> None:
    server.script(Reply(steps=[vllm_chunk("x", ["a"], finish="stop"), DONE]))  # type: ignore[list-item]
    async with ChatClient() as client:
        result = await client.chat(server.url, BODY)
    assert result.content == "x" and result.token_ids is None

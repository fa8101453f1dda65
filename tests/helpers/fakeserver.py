"""A scripted OpenAI-compatible chat server on 127.0.0.1, port 0, for client tests.

Each request to /v1/chat/completions takes the next `Reply` from the script. A reply is
either a plain body with a status, or a 200 event stream played step by step: bytes to
write, pauses, a stall until the test ends, or an abrupt disconnect. The server records
every request it saw so tests can check what was sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import orjson
from aiohttp import web


class Disconnect:
    """Close the TCP connection here, without ending the HTTP response."""


class Stall:
    """Send nothing more until the server shuts down."""


DISCONNECT = Disconnect()
STALL = Stall()
DONE = b"data: [DONE]\n\n"

# bytes: write them; float: pause that many seconds.
Step = bytes | float | Disconnect | Stall


@dataclass
class Reply:
    status: int = 200
    steps: Sequence[Step] = ()
    # A non-stream reply: sent whole, with this status.
    body: bytes | None = None
    content_type: str = "application/json"
    # Drop the connection before any response byte.
    disconnect_first: bool = False
    # Send nothing at all, not even headers, until the server shuts down.
    stall_first: bool = False


@dataclass
class SeenRequest:
    headers: dict[str, str]
    body: dict[str, Any]
    peer_port: int


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(
    content: str | None = None,
    *,
    reasoning: str | None = None,
    reasoning_key: str = "reasoning_content",
    finish: str | None = None,
    role: str | None = None,
) -> bytes:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta[reasoning_key] = reasoning
    return sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


def usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    return sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


def completion(
    texts: Sequence[str],
    *,
    finish: str = "stop",
    prompt_tokens: int = 7,
    completion_tokens: int | None = None,
) -> Reply:
    """A well-formed stream the way vLLM writes it: role, text, finish, usage, [DONE]."""
    steps: list[Step] = [chunk("", role="assistant")]
    steps += [chunk(t) for t in texts]
    steps.append(chunk(finish=finish))
    used = len(texts) if completion_tokens is None else completion_tokens
    steps += [usage(prompt_tokens, used), DONE]
    return Reply(steps=steps)


def error_reply(status: int, message: str, *, nested: bool = True) -> Reply:
    """An engine's JSON error body: newer vLLM nests it, SGLang and old vLLM do not."""
    fields = {"message": message, "type": "BadRequestError", "param": None, "code": status}
    obj: dict[str, Any] = {"error": fields} if nested else {"object": "error", **fields}
    return Reply(status=status, body=orjson.dumps(obj))


@dataclass
class FakeServer:
    replies: list[Reply] = field(default_factory=list)
    # Served as max_model_len at GET /v1/models when set (404 otherwise).
    context_tokens: int | None = None
    # Answers by request body instead of script order (for concurrent callers).
    responder: Callable[[dict[str, Any]], Reply] | None = None
    # Served as SGLang's GET /v1/loads when set.
    loads: Callable[[], Any] | None = None
    # POST /tokenize: the count for a request body (vLLM's shape), when set.
    tokenize: Callable[[dict[str, Any]], int] | None = None
    seen: list[SeenRequest] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    _runner: web.AppRunner | None = None
    _port: int = 0
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        if self.loads is not None:
            app.router.add_get("/v1/loads", self._loads)
        if self.tokenize is not None:
            app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        if self.context_tokens is None:
            return web.Response(status=404)
        data = {"data": [{"id": "fake", "max_model_len": self.context_tokens}]}
        return web.Response(body=orjson.dumps(data), content_type="application/json")

    async def _loads(self, request: web.Request) -> web.Response:
        assert self.loads is not None
        return web.Response(body=orjson.dumps(self.loads()), content_type="application/json")

    async def _tokenize(self, request: web.Request) -> web.Response:
        assert self.tokenize is not None
        count = self.tokenize(orjson.loads(await request.read()))
        return web.Response(body=orjson.dumps({"count": count, "tokens": [0] * count,
                                               "max_model_len": self.context_tokens}),
                            content_type="application/json")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        body = orjson.loads(await request.read())
        self.seen.append(
            SeenRequest(headers=dict(request.headers), body=body, peer_port=peer[1] if peer else 0)
        )
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._play(request, body)
        finally:
            self.active -= 1

    async def _play(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.replies:
            reply = self.replies.pop(0)
        elif self.responder is not None:
            reply = self.responder(body)
        else:
            reply = Reply(status=500, body=b"unscripted")
        if reply.disconnect_first:
            _drop(request)
            return web.Response()
        if reply.stall_first:
            await self._closing.wait()
            return web.Response()
        if reply.body is not None:
            return web.Response(
                status=reply.status, body=reply.body, content_type=reply.content_type
            )
        response = web.StreamResponse(status=reply.status)
        response.content_type = "text/event-stream"
        await response.prepare(request)
        for step in reply.steps:
            if isinstance(step, bytes):
                await response.write(step)
            elif isinstance(step, float):
                await asyncio.sleep(step)
            elif isinstance(step, Disconnect):
                _drop(request)
                return response
            else:
                await self._closing.wait()
                return response
        await response.write_eof()
        return response


def _drop(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()

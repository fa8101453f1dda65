# long: the proxy, its fault kinds on the wire and its command line are one tool, read together
"""A fault-injecting HTTP proxy in front of an OpenAI-compatible engine, for reliability tests.

    client (draftgen) ──HTTP──> FaultProxy ──HTTP──> engine (vLLM, SGLang)

Every request is forwarded. A chat completion request (POST /v1/chat/completions) may get a
fault instead, decided per request from a seeded `random.Random`: the same seed and the same
arrival order inject the same faults. What each kind looks like on the wire:

    status_500/503/429  that status and an OpenAI-style JSON error body; the engine never
                        sees the request
    reset_before        the request is read, then the TCP connection is reset (RST) before
                        any response byte
    reset_mid_stream    200 and the first N SSE events, then a TCP reset
    stall_mid_stream    200 and the first N events, then silence for `stall_s`, then the
                        connection is closed (FIN, the chunked body never ends)
    cut_stream          200 and the first N events, then a clean end of the chunked body:
                        no finish chunk, no usage chunk, no [DONE]

N is drawn from 1..20, and a mid-stream fault fires no later than the event that ends the
generation (one with a finish_reason, the usage chunk, [DONE]): a short completion still
gets its fault instead of slipping through whole. When a mid-stream fault fires, the
upstream response is closed, so the engine aborts that generation as it would for a client
that went away. A response that is not an event stream (`stream: false`) gets a mid-stream
fault after half its body.

`rewrites` (path -> old, new bytes) answers a GET of that path with the engine's body
changed: a worker that says it runs other settings than it does (the gateway tests' fp8).

`counts` says what happened, one entry per request: the fault kind injected, "forwarded"
for a chat request sent through clean, "passthrough" for any other request (health,
metrics, models), "upstream_error" when the engine could not be reached (answered 502).
A mid-stream fault drawn for a request the engine answers with an error status, or whose
stream ends without a finishing event, is not injected: that request counts as "forwarded".

Manual chaos runs: `python -m draftgen.testing.faultproxy --upstream URL --rate 0.1`
prints the proxy's URL, serves until SIGINT/SIGTERM, then prints the counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import socket
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from draftgen.testing.faults import (
    FAULT_KINDS,
    STATUS_FAULTS,
    Decision,
    FaultMix,
    FaultPicker,
    parse_weights,
)

CHAT_PATH = "/v1/chat/completions"
# Headers that describe one hop, not the message: the proxy's own connections set them.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# The blank line that ends an SSE event; engines write "\n\n", the grammar also allows CRLF.
_EVENT_END = re.compile(rb"\r?\n\r?\n")
# Prompts for long-context models are large; aiohttp's default request limit is 1 MiB.
_MAX_REQUEST_BYTES = 256 * 2**20


class FaultProxy:
    """An HTTP proxy on `host:port` (0: any free port) that forwards to `upstream`.

    `upstream` is the engine's base URL (scheme, host, port); request paths are appended
    to it unchanged.
    """

    def __init__(
        self,
        upstream: str,
        *,
        mix: FaultMix,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        rewrites: Mapping[str, tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        # path -> (old, new): a GET of that path answers the engine's body with `old`
        # replaced (a worker that says it runs other settings than it does).
        self._rewrites = dict(rewrites or {})
        self.mix = mix
        self.counts: Counter[str] = Counter()
        self._picker = FaultPicker(mix, seed)
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        # Set on close, so stalled responses end at once instead of holding shutdown.
        self._closing = asyncio.Event()

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("FaultProxy is not started")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        if self._runner is not None or self._session is not None:
            raise RuntimeError("FaultProxy is already started")
        self._closing = asyncio.Event()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            # A long generation must never be cut off by the proxy; timeouts are the client's.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            # Bodies pass through byte for byte, compressed or not.
            auto_decompress=False,
            # One client's cookies must not ride along on another's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that hangs up cancels its handler, which closes the
        # upstream request, so the engine stops generating for nobody.
        runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None
        )
        self._runner = runner
        try:
            await runner.setup()
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
        except BaseException:
            await self.close()
            raise
        self._port = runner.addresses[0][1]

    async def close(self) -> None:
        self._closing.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method != "POST" or request.path != CHAT_PATH:
            return await self._forward(request, body, None, chat=False)
        decision = self._picker.next()
        kind = decision.kind
        if kind is None:
            return await self._forward(request, body, None, chat=True)
        if kind in STATUS_FAULTS:
            self.counts[kind] += 1
            return _error_response(STATUS_FAULTS[kind], f"fault proxy: injected {kind}")
        if kind == "reset_before":
            self.counts[kind] += 1
            _reset(request)
            # Goes nowhere: aiohttp finds the transport closed and drops it quietly.
            return web.Response()
        return await self._forward(request, body, decision, chat=True)

    async def _forward(
        self, request: web.Request, body: bytes, fault: Decision | None, *, chat: bool
    ) -> web.StreamResponse:
        session = self._session
        if session is None:
            raise RuntimeError("FaultProxy is not started")
        try:
            upstream = await session.request(
                request.method,
                URL(self.upstream + request.raw_path, encoded=True),
                headers=_end_to_end(request.headers),
                data=body or None,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            self.counts["upstream_error"] += 1
            return _error_response(502, f"fault proxy: upstream {self.upstream}: {err!r}")
        async with upstream:
            try:
                if fault is not None and upstream.status == 200:
                    return await self._inject(request, upstream, fault)
                self.counts["forwarded" if chat else "passthrough"] += 1
                if (swap := self._rewrites.get(request.path)) is not None:
                    body = (await upstream.read()).replace(*swap)
                    return web.Response(status=upstream.status, body=body,
                                        content_type=upstream.content_type)
                return await _relay(request, upstream)
            except ConnectionError:
                # The client hung up; leaving `async with` closes the upstream request too.
                return web.Response()
            except aiohttp.ClientPayloadError:
                # The engine broke off its body: pass the break on rather than end ours cleanly.
                _reset(request)
                return web.Response()

    async def _inject(
        self, request: web.Request, upstream: aiohttp.ClientResponse, fault: Decision
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=_end_to_end(upstream.headers)
        )
        await response.prepare(request)
        if upstream.content_type != "text/event-stream":
            whole = await upstream.read()
            await response.write(whole[: len(whole) // 2])
            return await self._fire(fault, request, response, upstream)
        events = _EventSplitter()
        sent = 0
        async for data in upstream.content.iter_any():
            for event in events.feed(data):
                if sent >= fault.after_events or _ends_generation(event):
                    return await self._fire(fault, request, response, upstream)
                await response.write(event)
                sent += 1
        # The stream ended with no event that ends a generation: nothing left to break.
        rest = events.rest()
        if rest:
            await response.write(rest)
        self.counts["forwarded"] += 1
        await response.write_eof()
        return response

    async def _fire(
        self,
        fault: Decision,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
    ) -> web.StreamResponse:
        kind = fault.kind
        assert kind is not None
        self.counts[kind] += 1
        # Drops the upstream connection mid-body, which makes the engine abort the generation.
        upstream.close()
        if kind == "cut_stream":
            await response.write_eof()
        elif kind == "stall_mid_stream":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.mix.stall_s):
                    await self._closing.wait()
            if request.transport is not None:
                request.transport.close()
        else:
            _reset(request)
        return response


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    response = web.StreamResponse(
        status=upstream.status, reason=upstream.reason, headers=_end_to_end(upstream.headers)
    )
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    await response.prepare(request)
    async for data in upstream.content.iter_any():
        await response.write(data)
    await response.write_eof()
    return response


def _end_to_end(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


def _error_response(status: int, message: str) -> web.Response:
    # vLLM's error shape; the message names the proxy so a log shows the fault was injected.
    error = {"message": message, "type": "FaultProxyError", "param": None, "code": status}
    return web.Response(
        status=status, body=orjson.dumps({"error": error}), content_type="application/json"
    )


def _reset(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0 turns close into an RST: the client sees "connection reset by peer",
        # as when an engine process dies, not an orderly FIN.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _EventSplitter:
    """Bytes as they arrive → whole SSE events, each with its terminating blank line."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data
        events: list[bytes] = []
        start = 0
        for end in _EVENT_END.finditer(buffer):
            events.append(buffer[start : end.end()])
            start = end.end()
        self._buffer = buffer[start:]
        return events

    def rest(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


def _ends_generation(event: bytes) -> bool:
    """Whether this event finishes the completion: a finish_reason, the usage chunk, [DONE]."""
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return True
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        choices = obj.get("choices")
        if not choices:
            # The usage chunk, or an error object: either way the text is over.
            return True
        return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
    return False


async def _serve(upstream: str, mix: FaultMix, seed: int, host: str, port: int) -> Counter[str]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with FaultProxy(upstream, mix=mix, seed=seed, host=host, port=port) as proxy:
        print(proxy.url, flush=True)
        await stop.wait()
    return proxy.counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m draftgen.testing.faultproxy",
        description="Forward to an OpenAI-compatible engine, injecting faults into chat "
        "completions. Prints its URL, serves until interrupted, then prints the counts.",
    )
    parser.add_argument("--upstream", required=True, help="engine base URL, e.g. http://h:8000")
    parser.add_argument("--rate", type=float, default=0.10, help="share of requests faulted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--stall-s", type=float, default=30.0)
    parser.add_argument(
        "--kinds",
        default=None,
        help=f"comma list of kind[=weight]; default all equally: {','.join(FAULT_KINDS)}",
    )
    args = parser.parse_args(argv)
    try:
        weights = parse_weights(args.kinds)
        mix = FaultMix(rate=args.rate, weights=weights, stall_s=args.stall_s)
    except ValueError as err:
        parser.error(str(err))
    counts = asyncio.run(_serve(args.upstream, mix, args.seed, args.host, args.port))
    print(json.dumps(dict(sorted(counts.items()))), flush=True)


if __name__ == "__main__":
    main()

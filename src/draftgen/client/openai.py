"""Streaming chat completions from OpenAI-compatible engines (vLLM, SGLang) over one session.

`ChatClient.chat` sends one request and returns a `Completion`, or raises one typed
`RequestError` (see `classify.py`). Everything aiohttp can raise is translated here, so the
rest of draftgen never sees a transport exception.

The stream loop runs once per received chunk for every live request, so it stays flat:
one `orjson.loads` and a few dict lookups per event, text collected in lists and joined
once at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

import aiohttp
import orjson

from draftgen.client.classify import (
    classify_status,
    classify_stream_error,
    error_object,
    excerpt,
    redact,
)
from draftgen.client.http import KEEPALIVE_S
from draftgen.client.sse import DONE, SSEDecoder
from draftgen.clock import REAL_CLOCK, Clock
from draftgen.errors import RequestError, RunError, ServerDown, Transient
from draftgen.gateways.registry import served_by as served_worker
from draftgen.sample import Turn

CHAT_PATH = "/v1/chat/completions"

# After `[DONE]` only the end of the chunked body is left; reading it lets the connection
# go back to the pool. The bound keeps a server that leaves the stream open from holding a
# finished result.
_DRAIN_S = 1.0
# finish_reason values that mean the engine gave up on the request rather than finished it.
_ABORTED = frozenset({"abort", "error"})
# What a chunk of the wrong shape raises on the way through the parsing code; a
# try block costs nothing until one does.
_MALFORMED = (orjson.JSONDecodeError, AttributeError, TypeError, IndexError, KeyError, ValueError)


# One generated reply is stored exactly as the client returns it (`completion_tokens` comes
# from the server's usage report only; 0 when the server sent none).
Completion = Turn


class ChatClient:
    """One long-lived HTTP session for every request of a run.

    `idle_timeout_s` bounds the silence between received bytes, never the whole request:
    a 30-minute generation that keeps streaming is healthy. It also bounds the wait for the
    first byte, and SGLang sends nothing until a request is scheduled, so time spent queued
    in the engine counts against it.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        idle_timeout_s: float = 300,
        connect_timeout_s: float = 30,
        max_connections: int = 0,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        if idle_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if max_connections < 0:
            raise ValueError("max_connections must be >= 0 (0 means unlimited)")
        self._api_key = api_key or None
        self._idle_timeout_s = idle_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        if self._session is not None:
            raise RuntimeError("ChatClient is already open")
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=KEEPALIVE_S
            ),
            # No `total` and no `connect`: waiting for a pooled connection is the
            # scheduler's business, and a long generation must never be cut off.
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=None,
                sock_connect=self._connect_timeout_s,
                sock_read=self._idle_timeout_s,
            ),
            headers=headers,
            raise_for_status=False,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def chat(
        self,
        server_url: str,
        body: dict[str, Any],
        *,
        on_token: Callable[[int], None] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Completion:
        """Stream one chat completion from `server_url` (scheme, host, port).

        `headers` go with this request only (a gateway's routing key); the worker a gateway
        names in its answer is the completion's `served_by`.

        `on_token(n)` runs for every chunk that carries text, with the number of tokens the
        reply has so far; it must be cheap. The count comes from the usage that vLLM and
        SGLang put in every chunk when asked (`continuous_usage_stats`): a server that falls
        behind its readers packs several tokens into one chunk. A server that sends no
        usage per chunk is counted one token per chunk.
        """
        session = self._session
        if session is None:
            raise RuntimeError("use ChatClient inside `async with`")
        url = _chat_url(server_url)
        stream_options = {"continuous_usage_stats": True,
                          **(body.get("stream_options") or {}), "include_usage": True}
        data = orjson.dumps({**body, "stream": True, "stream_options": stream_options})
        clock = self._clock
        started = clock.monotonic()
        try:
            response = await session.post(url, data=data, allow_redirects=False,
                                          headers=headers)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise self._before_response_error(err, url) from err
        async with response:
            served_by = served_worker(response.headers)
            if not 200 <= response.status < 300:
                raise classify_status(
                    response.status, await _read_error_body(response), secret=self._api_key
                )
            if response.content_type == "application/json":
                # A server that ignored `stream: true`; rare, so not worth a fast path.
                done = await self._from_json(response, started)
            else:
                try:
                    done = await self._read_stream(response, started, on_token)
                except (aiohttp.ClientError, TimeoutError) as err:
                    raise self._mid_stream_error(err) from err
        return dataclasses.replace(done, served_by=served_by.rstrip("/")) if served_by else done

    async def fetch_json(self, server_url: str, path: str, body: Any = None, *,
                         timeout_s: float) -> tuple[int, Any]:
        """GET `path` (POST `body` when given) on the server: (status, parsed JSON or None).
        A server that does not answer within `timeout_s` raises `ServerDown` (refused) or
        `Transient`, like a chat request would."""
        session = self._session
        if session is None:
            raise RuntimeError("use ChatClient inside `async with`")
        url = _chat_url(server_url).removesuffix(CHAT_PATH) + path
        try:
            async with asyncio.timeout(timeout_s):
                request = (session.get(url) if body is None else
                           session.post(url, data=orjson.dumps(body)))
                async with request as r:
                    raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as err:
            if isinstance(err, TimeoutError):
                raise Transient(f"no answer from {url} within {timeout_s:g}s") from err
            raise self._before_response_error(err, url) from err
        try:
            return r.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return r.status, None

    async def _read_stream(
        self,
        response: aiohttp.ClientResponse,
        started: float,
        on_token: Callable[[int], None] | None,
    ) -> Completion:
        clock = self._clock
        loads = orjson.loads
        content_parts: list[str] = []
        reasoning_parts: list[str] = []
        finish_reason: str | None = None
        prompt_tokens = completion_tokens = written = 0
        ttft_s: float | None = None
        # Token ids, where the server sends them: vLLM per chunk (choices[0].token_ids) and
        # the prompt's on the first; SGLang once, in a chunk of its own (sglext).
        ids: list[int] | None = None
        prompt_ids: list[int] | None = None
        done = False
        decoder = SSEDecoder()
        stream = response.content
        while not done:
            raw = await stream.readany()
            payloads = decoder.feed(raw) if raw else decoder.close()
            for payload in payloads:
                if payload == DONE:
                    done = True
                    break
                try:
                    event = loads(payload)
                    usage = event.get("usage")
                    if usage:
                        prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        completion_tokens = int(usage.get("completion_tokens") or 0)
                    if "prompt_token_ids" in event or "sglext" in event:
                        prompt_ids, sglext_ids = _ids_of(event, prompt_ids)
                        if sglext_ids is not None:
                            ids = sglext_ids
                    choices = event.get("choices")
                    if choices:
                        choice = choices[0]
                        step_ids = choice.get("token_ids")
                        if step_ids:
                            if ids is None:
                                ids = []
                            ids.extend(step_ids)
                        delta = choice.get("delta")
                        if delta:
                            text = delta.get("content")
                            thought = delta.get("reasoning_content") or delta.get("reasoning")
                            if text:
                                content_parts.append(text)
                            if thought:
                                reasoning_parts.append(thought)
                            if text or thought:
                                if ttft_s is None:
                                    ttft_s = clock.monotonic() - started
                                written = completion_tokens if usage else written + 1
                                if on_token is not None:
                                    on_token(written)
                        reason = choice.get("finish_reason")
                        if reason:
                            finish_reason = reason
                    elif "sglext" not in event:
                        server_error = error_object(event)
                        if server_error is not None:
                            raise classify_stream_error(server_error, secret=self._api_key)
                except _MALFORMED as err:
                    raise Transient(f"malformed stream chunk: {_snippet(payload)}") from err
            if not raw:
                break
        if done:
            await _drain(response)
        elif finish_reason is None:
            raise Transient("stream ended early: no finish_reason and no [DONE]")
        if finish_reason in _ABORTED:
            raise Transient(f"the server aborted the generation (finish_reason={finish_reason})")
        try:
            content = "".join(content_parts)
            reasoning = "".join(reasoning_parts) if reasoning_parts else None
        except TypeError as err:
            raise Transient("malformed stream chunk: text that is not a string") from err
        return Completion(
            content=content,
            reasoning=reasoning,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft_s=ttft_s,
            duration_s=clock.monotonic() - started,
            token_ids=_int_tuple(ids),
            prompt_token_ids=_int_tuple(prompt_ids),
        )

    async def _from_json(self, response: aiohttp.ClientResponse, started: float) -> Completion:
        try:
            raw = await response.read()
        except (aiohttp.ClientError, TimeoutError) as err:
            raise self._mid_stream_error(err) from err
        try:
            obj = orjson.loads(raw)
            server_error = error_object(obj)
            if server_error is not None:
                raise classify_stream_error(server_error, secret=self._api_key)
            choice = obj["choices"][0]
            message = choice.get("message") or {}
            usage = obj.get("usage") or {}
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            return Completion(
                content=message.get("content") or "",
                reasoning=reasoning or None,
                finish_reason=choice.get("finish_reason"),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                ttft_s=None,
                duration_s=self._clock.monotonic() - started,
            )
        except _MALFORMED as err:
            raise Transient(f"malformed response: {_snippet(raw)}") from err

    def _before_response_error(self, err: BaseException, url: str) -> RequestError:
        """Nothing of the response arrived: decide between a dead server and a slow one."""
        detail = redact(str(err) or type(err).__name__, self._api_key)
        if isinstance(err, aiohttp.ConnectionTimeoutError):
            return ServerDown(f"cannot connect to {url}: no answer in {self._connect_timeout_s}s")
        if isinstance(err, TimeoutError):
            return Transient(f"no response from {url} for {self._idle_timeout_s}s")
        if isinstance(err, aiohttp.InvalidURL):
            return RunError(f"invalid server URL: {detail}")
        if isinstance(err, aiohttp.ClientConnectorError | aiohttp.ServerDisconnectedError):
            return ServerDown(f"cannot reach {url}: {detail}")
        if isinstance(err, aiohttp.ClientOSError):
            # Reset or broken pipe while sending: the process behind the port is gone.
            return ServerDown(f"connection to {url} failed: {detail}")
        return Transient(f"request to {url} failed: {type(err).__name__}: {detail}")

    def _mid_stream_error(self, err: BaseException) -> RequestError:
        """The response had started: whatever broke, the server was alive a moment ago."""
        if isinstance(err, TimeoutError):
            return Transient(f"stream stalled: no data for {self._idle_timeout_s:g}s")
        detail = redact(str(err) or type(err).__name__, self._api_key)
        return Transient(f"stream broken: {type(err).__name__}: {detail}")


def _chat_url(server_url: str) -> str:
    base = server_url.rstrip("/")
    # Accept the OpenAI SDK's habit of a base URL ending in /v1.
    if base.endswith("/v1"):
        base = base[:-3]
    return base + CHAT_PATH


async def _read_error_body(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""


async def _drain(response: aiohttp.ClientResponse) -> None:
    try:
        async with asyncio.timeout(_DRAIN_S):
            while await response.content.readany():
                pass
    except (aiohttp.ClientError, TimeoutError):
        # The result is complete; at worst this connection is not reused.
        pass


def _ids_of(event: dict[str, Any], prompt_ids: list[int] | None
            ) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, generated ids) a chunk carries outside its choices: vLLM's top-level
    `prompt_token_ids`; SGLang's `sglext.input_ids` and `sglext.output_ids[0]`."""
    prompt = event.get("prompt_token_ids")
    generated = None
    sglext = event.get("sglext")
    if isinstance(sglext, dict):
        prompt = sglext.get("input_ids", prompt)
        outputs = sglext.get("output_ids")
        if isinstance(outputs, list) and outputs and isinstance(outputs[0], list):
            generated = outputs[0]
    return (prompt if isinstance(prompt, list) else prompt_ids), generated


def _int_tuple(ids: list[Any] | None) -> tuple[int, ...] | None:
    """The ids as stored; None when absent or malformed (an optional field: the answer
    itself is complete, and the tokens export then tokenises its text instead)."""
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return tuple(ids)


def _snippet(payload: bytes) -> str:
    return excerpt(payload[:200])

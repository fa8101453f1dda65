"""FaultProxy between raw aiohttp / draftgen's ChatClient and a real in-process streaming server.

Each fault kind is checked on its own (rate 1, one kind) by what a client can observe on
the wire, and then by the typed error draftgen's client turns it into: that mapping is
what the runner's retry and pause logic relies on.
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any, Self

import aiohttp
import orjson
import pytest
from aiohttp import web

from draftgen.client import ChatClient
from draftgen.errors import RequestError, ServerDown, Transient
from draftgen.testing.faultproxy import CHAT_PATH, FaultProxy, _EventSplitter
from draftgen.testing.faults import FAULT_KINDS, FaultMix, FaultPicker
from helpers.fakeserver import DONE, chunk, usage

CONTENT = [f"tok{i} " for i in range(30)]
ENDLESS = "endless"  # model name that makes the upstream stream until the client goes away
BROKEN = "broken"  # model name that makes the upstream drop its connection after three events


def stream_events(n: int) -> list[bytes]:
    """What vLLM writes for `n` tokens: role, text, finish, usage, [DONE]."""
    texts = [f"tok{i} " for i in range(n)]
    return [
        chunk("", role="assistant"),
        *(chunk(t) for t in texts),
        chunk(finish="stop"),
        usage(5, n),
        DONE,
    ]


class Upstream:
    """A small engine stand-in: streams a fixed completion, serves health and models."""

    def __init__(self) -> None:
        self.chat_requests = 0
        # Set when a streaming handler sees its client go away before the stream ended.
        self.client_left = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post(CHAT_PATH, self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok", headers={"X-Upstream": "yes"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.chat_requests += 1
        body = await request.json()
        n = int(body.get("max_tokens") or len(CONTENT))
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(CONTENT[:n])}
            return web.json_response(
                {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
            )
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        try:
            if body.get("model") == ENDLESS:
                await response.write(chunk("", role="assistant"))
                while True:
                    await response.write(chunk("x"))
                    await asyncio.sleep(0.002)
            for i, event in enumerate(stream_events(n)):
                if body.get("model") == BROKEN and i == 3:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await response.write(event)
        except (asyncio.CancelledError, ConnectionError):
            self.client_left.set()
            raise
        await response.write_eof()
        return response


def chat_body(*, max_tokens: int = 30, model: str = "tiny", stream: bool = True) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def only(kind: str, *, stall_s: float = 30.0) -> FaultMix:
    return FaultMix(rate=1.0, weights={kind: 1}, stall_s=stall_s)


def events_of(raw: bytes) -> list[bytes]:
    splitter = _EventSplitter()
    events = splitter.feed(raw)
    assert splitter.rest() == b""
    return events


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with Upstream() as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def read_all(response: aiohttp.ClientResponse) -> tuple[bytes, BaseException | None]:
    """Everything that arrived, and the error that ended the body (None: a clean end)."""
    parts: list[bytes] = []
    try:
        while data := await response.content.readany():
            parts.append(data)
    except (aiohttp.ClientError, TimeoutError) as err:
        return b"".join(parts), err
    return b"".join(parts), None


# --- clean forwarding --------------------------------------------------------------------


async def test_rate_zero_stream_is_byte_identical(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with FaultProxy(upstream.url, mix=FaultMix(rate=0.0)) as proxy:
        async with session.post(upstream.url + CHAT_PATH, json=chat_body()) as direct:
            want = await direct.read()
        async with session.post(proxy.url + CHAT_PATH, json=chat_body()) as via:
            assert via.status == 200
            assert via.content_type == "text/event-stream"
            got = await via.read()
    assert want == b"".join(stream_events(len(CONTENT)))
    assert got == want
    assert proxy.counts == {"forwarded": 1}


async def test_non_chat_paths_pass_through_clean_even_at_rate_one(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with FaultProxy(upstream.url, mix=FaultMix(rate=1.0)) as proxy:
        async with session.get(proxy.url + "/health") as health:
            assert health.status == 200
            assert await health.text() == "ok"
            assert health.headers["X-Upstream"] == "yes"
        async with session.get(proxy.url + "/v1/models") as models:
            assert (await models.json())["data"][0]["id"] == "tiny"
        async with session.get(proxy.url + "/nowhere") as missing:
            assert missing.status == 404
    assert proxy.counts == {"passthrough": 3}


async def test_unreachable_upstream_is_a_502(session: aiohttp.ClientSession) -> None:
    async with Upstream() as gone:
        dead_url = gone.url
    async with (
        FaultProxy(dead_url, mix=FaultMix(rate=0.0)) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body()) as response,
    ):
        assert response.status == 502
        assert "fault proxy" in (await response.json())["error"]["message"]
        async with ChatClient() as client:
            with pytest.raises(ServerDown):
                await client.chat(proxy.url, chat_body())
    assert proxy.counts == {"upstream_error": 2}


async def test_client_leaving_a_clean_stream_stops_the_upstream(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with FaultProxy(upstream.url, mix=FaultMix(rate=0.0)) as proxy:
        response = await session.post(proxy.url + CHAT_PATH, json=chat_body(model=ENDLESS))
        assert response.status == 200
        assert await response.content.readany()
        response.close()
        await asyncio.wait_for(upstream.client_left.wait(), 10)


async def test_an_upstream_break_is_passed_on_not_papered_over(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with (
        FaultProxy(upstream.url, mix=FaultMix(rate=0.0)) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body(model=BROKEN)) as response,
    ):
        raw, err = await read_all(response)
    assert isinstance(err, aiohttp.ClientPayloadError)
    assert raw == b"".join(stream_events(len(CONTENT))[:3])
    assert proxy.counts == {"forwarded": 1}


# --- each fault kind on the wire ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status"), [("status_500", 500), ("status_503", 503), ("status_429", 429)]
)
async def test_status_fault_answers_without_the_upstream(
    upstream: Upstream, session: aiohttp.ClientSession, kind: str, status: int
) -> None:
    async with (
        FaultProxy(upstream.url, mix=only(kind)) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body()) as response,
    ):
        assert response.status == status
        error = (await response.json())["error"]
    assert error["code"] == status
    assert kind in error["message"]
    assert upstream.chat_requests == 0
    assert proxy.counts == {kind: 1}


async def test_reset_before_drops_the_connection_before_any_header(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with FaultProxy(upstream.url, mix=only("reset_before")) as proxy:
        with pytest.raises(aiohttp.ClientOSError) as caught:
            await session.post(proxy.url + CHAT_PATH, json=chat_body())
    # An RST, as from a killed engine, not an orderly close.
    assert caught.value.errno == errno.ECONNRESET
    assert upstream.chat_requests == 0
    assert proxy.counts == {"reset_before": 1}


async def test_reset_mid_stream_breaks_the_body_after_some_events(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with (
        FaultProxy(upstream.url, mix=only("reset_mid_stream")) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body()) as response,
    ):
        assert response.status == 200
        raw, err = await read_all(response)
    assert isinstance(err, aiohttp.ClientPayloadError)
    assert "Connection reset by peer" in str(err)
    assert DONE not in raw
    assert b'finish_reason":"stop' not in raw
    assert proxy.counts == {"reset_mid_stream": 1}


async def test_stall_mid_stream_goes_silent(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    after = FaultPicker(only("stall_mid_stream"), 0).next().after_events
    async with FaultProxy(upstream.url, mix=only("stall_mid_stream", stall_s=0.5)) as proxy:
        timeout = aiohttp.ClientTimeout(sock_read=0.2)
        async with session.post(
            proxy.url + CHAT_PATH, json=chat_body(), timeout=timeout
        ) as response:
            assert response.status == 200
            raw, err = await read_all(response)
    assert isinstance(err, TimeoutError)
    assert len(events_of(raw)) == after
    assert proxy.counts == {"stall_mid_stream": 1}


async def test_stall_ends_in_a_closed_connection(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with (
        FaultProxy(upstream.url, mix=only("stall_mid_stream", stall_s=0.1)) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body()) as response,
    ):
        raw, err = await read_all(response)
    # The chunked body never got its end, so this is a broken body, not a finished one.
    assert isinstance(err, aiohttp.ClientPayloadError)
    assert "reset" not in str(err)
    assert DONE not in raw


async def test_cut_stream_ends_cleanly_without_finish_or_done(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    after = FaultPicker(only("cut_stream"), 0).next().after_events
    async with (
        FaultProxy(upstream.url, mix=only("cut_stream")) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body()) as response,
    ):
        assert response.status == 200
        raw, err = await read_all(response)
    assert err is None
    assert raw == b"".join(stream_events(len(CONTENT))[:after])
    assert proxy.counts == {"cut_stream": 1}


@pytest.mark.parametrize("seed", range(12))
async def test_a_short_stream_still_loses_its_end(
    upstream: Upstream, session: aiohttp.ClientSession, seed: int
) -> None:
    # Two tokens make five events; most drawn fault points lie beyond them.
    async with (
        FaultProxy(upstream.url, mix=only("cut_stream"), seed=seed) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body(max_tokens=2)) as response,
    ):
        raw, err = await read_all(response)
    assert err is None
    assert b'finish_reason":"stop' not in raw
    assert DONE not in raw
    assert proxy.counts == {"cut_stream": 1}


async def test_non_stream_response_is_cut_halfway(
    upstream: Upstream, session: aiohttp.ClientSession
) -> None:
    async with (
        FaultProxy(upstream.url, mix=only("cut_stream")) as proxy,
        session.post(proxy.url + CHAT_PATH, json=chat_body(stream=False)) as response,
    ):
        raw, err = await read_all(response)
    assert err is None
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    assert proxy.counts == {"cut_stream": 1}


@pytest.mark.parametrize("kind", sorted(["reset_mid_stream", "stall_mid_stream", "cut_stream"]))
async def test_mid_stream_fault_cancels_the_upstream_request(
    upstream: Upstream, session: aiohttp.ClientSession, kind: str
) -> None:
    # A long stall: the upstream must be let go when the fault fires, not when it ends.
    proxy = FaultProxy(upstream.url, mix=only(kind, stall_s=60))
    async with proxy:
        response = await session.post(proxy.url + CHAT_PATH, json=chat_body(model=ENDLESS))
        await asyncio.wait_for(upstream.client_left.wait(), 10)
        response.close()
        # Closing must not wait out the stall.
        async with asyncio.timeout(10):
            await proxy.close()
    assert proxy.counts == {kind: 1}


# --- what draftgen's client makes of each fault ------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected", "says"),
    [
        ("status_500", Transient, "HTTP 500"),
        ("status_429", Transient, "HTTP 429"),
        ("status_503", ServerDown, "HTTP 503"),
        ("reset_before", ServerDown, ""),
        ("reset_mid_stream", Transient, "stream broken"),
        ("stall_mid_stream", Transient, "stalled"),
        ("cut_stream", Transient, "ended early"),
    ],
)
async def test_chat_client_classifies_each_fault(
    upstream: Upstream, kind: str, expected: type[RequestError], says: str
) -> None:
    async with (
        FaultProxy(upstream.url, mix=only(kind, stall_s=30)) as proxy,
        ChatClient(idle_timeout_s=0.3) as client,
    ):
        with pytest.raises(RequestError) as caught:
            await client.chat(proxy.url, chat_body())
    # Exactly: a Transient where ServerDown is expected would not pause the runner, and a
    # ServerDown for a broken stream would pause it for nothing.
    assert type(caught.value) is expected
    assert says in str(caught.value)
    assert caught.value.retryable


async def test_chat_client_gets_the_whole_completion_at_rate_zero(upstream: Upstream) -> None:
    async with (
        FaultProxy(upstream.url, mix=FaultMix(rate=0.0)) as proxy,
        ChatClient() as client,
    ):
        done = await client.chat(proxy.url, chat_body())
    assert done.content == "".join(CONTENT)
    assert done.finish_reason == "stop"
    assert done.completion_tokens == len(CONTENT)


# --- the decision sequence ---------------------------------------------------------------


async def outcome(session: aiohttp.ClientSession, url: str) -> str:
    """What a client saw, in one word: ok, a status, cut, or error."""
    try:
        async with session.post(url + CHAT_PATH, json=chat_body()) as response:
            if response.status != 200:
                return str(response.status)
            raw, err = await read_all(response)
    except aiohttp.ClientError:
        return "error"
    if err is not None:
        return "error"
    return "ok" if raw.endswith(DONE) else "cut"


async def run_sequence(upstream: Upstream, seed: int) -> tuple[list[str], dict[str, int]]:
    mix = FaultMix(rate=0.1, stall_s=0.01)
    async with (
        aiohttp.ClientSession() as session,
        FaultProxy(upstream.url, mix=mix, seed=seed) as p,
    ):
        seen = [await outcome(session, p.url) for _ in range(200)]
    return seen, dict(p.counts)


async def test_rate_gives_plausible_reproducible_counts(upstream: Upstream) -> None:
    seen, counts = await run_sequence(upstream, seed=7)
    again, counts_again = await run_sequence(upstream, seed=7)
    other, _ = await run_sequence(upstream, seed=8)
    assert again == seen
    assert counts_again == counts
    assert other != seen
    faults = sum(n for kind, n in counts.items() if kind != "forwarded")
    assert 5 <= faults <= 40
    assert sum(counts.values()) == 200
    # What the client saw matches what the proxy says it did.
    assert seen.count("ok") == counts["forwarded"]
    assert seen.count("cut") == counts.get("cut_stream", 0)
    for kind, status in (("status_500", "500"), ("status_503", "503"), ("status_429", "429")):
        assert seen.count(status) == counts.get(kind, 0)
    broken = ("reset_before", "reset_mid_stream", "stall_mid_stream")
    assert seen.count("error") == sum(counts.get(k, 0) for k in broken)


def test_picker_is_deterministic_and_weights_pick_only_their_kinds() -> None:
    mix = FaultMix(rate=0.3)
    first = [FaultPicker(mix, 3).next() for _ in range(1)]
    picker_a, picker_b = FaultPicker(mix, 3), FaultPicker(mix, 3)
    run_a = [picker_a.next() for _ in range(500)]
    assert run_a == [picker_b.next() for _ in range(500)]
    assert run_a[0] == first[0]
    assert {d.kind for d in run_a} == {None, *FAULT_KINDS}
    assert all(1 <= d.after_events <= 20 for d in run_a)
    # Which requests are hit depends on seed and rate alone, not on the weights.
    cut = FaultPicker(FaultMix(rate=0.3, weights={"cut_stream": 1}), 3)
    run_cut = [cut.next() for _ in range(500)]
    assert [d.kind is None for d in run_cut] == [d.kind is None for d in run_a]
    assert {d.kind for d in run_cut} == {None, "cut_stream"}


def test_fault_mix_validates_and_keeps_its_own_weights() -> None:
    with pytest.raises(ValueError, match="unknown fault kinds"):
        FaultMix(weights={"status_502": 1})
    with pytest.raises(ValueError, match="rate"):
        FaultMix(rate=1.5)
    with pytest.raises(ValueError, match="at least one"):
        FaultMix(rate=0.5, weights={"cut_stream": 0})
    with pytest.raises(ValueError, match=">= 0"):
        FaultMix(weights={"cut_stream": -1})
    FaultMix(rate=0.0, weights={})
    weights = {"cut_stream": 1.0}
    mix = FaultMix(weights=weights)
    weights["status_500"] = 1.0
    assert dict(mix.weights) == {"cut_stream": 1.0}
    assert hash(mix) == hash(FaultMix(weights={"status_503": 1.0}))


# --- command line ------------------------------------------------------------------------


async def test_cli_prints_its_url_serves_and_reports_counts(upstream: Upstream) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "draftgen.testing.faultproxy",
        "--upstream",
        upstream.url,
        "--rate",
        "1",
        "--kinds",
        "status_429",
        "--seed",
        "1",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        assert url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as health:
                assert await health.text() == "ok"
            async with session.post(url + CHAT_PATH, json=chat_body()) as chat:
                assert chat.status == 429
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert json.loads(out.decode().strip().splitlines()[-1]) == {
        "passthrough": 1,
        "status_429": 1,
    }


async def test_cli_rejects_an_unknown_kind() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "draftgen.testing.faultproxy",
        "--upstream",
        "http://127.0.0.1:9",
        "--kinds",
        "status_418",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"unknown fault kinds" in err

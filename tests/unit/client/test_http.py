"""The plain HTTP session (server info, load, the probe's scoring): idle connections are
dropped before a server's keep-alive timeout would close them under a request."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from draftgen.client import http
from draftgen.client.http import get_text, open_session


async def test_an_idle_connection_is_dropped_before_the_servers_keep_alive_ends(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn closes a connection idle 5 s; a request written onto it as it closes fails
    # with "Server disconnected" (aiohttp keeps idle connections 15 s by default). Scaled
    # down here: connections kept 0.2 s, a request after 0.4 s idle opens a new one.
    monkeypatch.setattr(http, "KEEPALIVE_S", 0.2)
    peers: list[object] = []

    async def handler(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport
                     else None)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with open_session() as session:
            url = f"http://127.0.0.1:{port}/"
            assert await get_text(session, url) == "ok"
            assert await get_text(session, url) == "ok"  # at once: the same connection
            await asyncio.sleep(0.4)
            assert await get_text(session, url) == "ok"
    finally:
        await runner.cleanup()
    assert peers[0] == peers[1] != peers[2], peers

"""Plain HTTP for the readers that are not chat streams (server info, load, scoring): one
session maker, so the rest of the code names no HTTP library."""

from __future__ import annotations

import asyncio

import aiohttp

from draftgen.servers.info import bearer

# What a session is, for annotations elsewhere.
Session = aiohttp.ClientSession

# uvicorn (vLLM, SGLang) closes idle keep-alive connections after 5 s. Dropping ours a little
# sooner keeps a request from being written onto a socket the server is just closing (aiohttp
# keeps them 15 s: a probe whose candidate sat idle 5 s got "Server disconnected").
KEEPALIVE_S = 4.0


def open_session(api_key: str | None = None, *, timeout_s: float | None = None) -> Session:
    """A session that sends the job's API key (if any) with every request."""
    connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
    if timeout_s is None:
        return aiohttp.ClientSession(headers=bearer(api_key), connector=connector)
    return aiohttp.ClientSession(headers=bearer(api_key), connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def get_text(session: Session, url: str, *, timeout_s: float = 10.0) -> str | None:
    """The body at `url` on a 200; None for any other answer or none at all."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def answers(session: Session, url: str, *, timeout_s: float = 5.0) -> bool:
    """Whether anything answers HTTP at `url`, whatever the status (an error page, 401
    included): False only when nothing does (refused, unreachable, silent)."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url):
            return True
    except (aiohttp.ClientError, TimeoutError):
        return False

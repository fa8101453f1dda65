"""Plain HTTP for the readers that are not chat streams (server info, load, scoring): one
session maker, so the rest of the code names no HTTP library."""

from __future__ import annotations

import asyncio

import aiohttp

from draftgen.servers.info import bearer

# What a session is, for annotations elsewhere.
Session = aiohttp.ClientSession


def open_session(api_key: str | None = None, *, timeout_s: float | None = None) -> Session:
    """A session that sends the job's API key (if any) with every request."""
    if timeout_s is None:
        return aiohttp.ClientSession(headers=bearer(api_key))
    return aiohttp.ClientSession(headers=bearer(api_key),
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

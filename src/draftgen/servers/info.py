"""Read what a running server actually uses, whichever engine it is.

`fetch_server_info` asks each engine of the registry in turn and returns the first answer,
so a URL needs no label. This is what `run` records in the manifest and what the quality
policy checks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from draftgen.engines.info import ServerInfo, ServerInfoError
from draftgen.engines.registry import ENGINES, engine_for
from draftgen.servers.profile import ServerProfile, profile_hash

__all__ = [
    "ServerInfo",
    "ServerInfoError",
    "bearer",
    "check_health",
    "engine_for",
    "fetch_server_info",
    "manifest_record",
]


def bearer(api_key: str | None) -> dict[str, str] | None:
    """The Authorization header for a server behind an API key (a server launched with
    --api-key guards /server_info and /metrics too)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


@asynccontextmanager
async def _session(
    session_or_url: aiohttp.ClientSession | str, url: str | None, api_key: str | None = None
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    if isinstance(session_or_url, str):
        async with aiohttp.ClientSession(headers=bearer(api_key)) as session:
            yield session, session_or_url.rstrip("/")
    else:
        if url is None:
            raise ValueError("pass url= with a session")
        yield session_or_url, url.rstrip("/")


async def fetch_server_info(
    session_or_url: aiohttp.ClientSession | str,
    url: str | None = None,
    *,
    profile: ServerProfile | None = None,
    engine: str | None = None,
    api_key: str | None = None,
) -> ServerInfo:
    """What the server at the URL runs with.

    Call as `fetch_server_info("http://host:port")` or `fetch_server_info(session, url)`.
    `profile` (the one it was launched from) tells the engine and helps resolve an `auto`
    dtype; `engine` skips detection. Raises `ServerInfoError` when the server cannot be
    reached or answers like neither engine.
    """
    async with _session(session_or_url, url, api_key) as (session, base):
        name = engine or (profile.engine if profile is not None else None)
        candidates = [engine_for(name)] if name else list(ENGINES.values())
        for candidate in candidates:
            info = await candidate.read_info(session, base, profile=profile)
            if info is not None:
                return info
    expected = name or " or ".join(ENGINES)
    signs = " and no ".join(c.signature for c in candidates)
    raise ServerInfoError(f"{base} does not answer like {expected}: no {signs}")


async def check_health(
    session_or_url: aiohttp.ClientSession | str,
    url: str | None = None,
    *,
    path: str = "/health",
    timeout_s: float = 30.0,
) -> bool:
    """Whether GET `path` answers 200. On SGLang `/health` runs a real one-token generation."""
    async with _session(session_or_url, url) as (session, base):
        try:
            async with session.get(
                f"{base}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def manifest_record(
    info: ServerInfo,
    *,
    profile: ServerProfile | None = None,
    quality_stamp: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A server's entry for a run manifest: what it runs with, and where that came from."""
    return {
        **info.to_json(),
        "profile": str(profile.source_file) if profile and profile.source_file else None,
        "profile_hash": profile_hash(profile) if profile is not None else None,
        "quality_override": quality_stamp,
    }

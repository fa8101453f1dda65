"""What the A/B probe asks of a server: render, continue greedily, score — the contract each
engine's `scoring.py` implements, and the one HTTP session both servers share.

All of it in token ids: a chat prompt is rendered to ids once, then every request sends
ids, so two servers are compared on exactly the same input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from draftgen.errors import DraftgenError
from draftgen.sample import Message

_ERROR_SNIPPET_CHARS = 300


class ProbeError(DraftgenError):
    """The probe could not be run: a server is unreachable, refused, or answered oddly."""


@dataclass(frozen=True, slots=True)
class Position:
    """One teacher-forced position as one server sees it."""

    token: int  # the forced (reference greedy) token
    logprob: float  # its log-probability
    top1: int  # this server's most likely token here
    top: dict[int, float]  # the top-k: token id -> log-probability


class Http:
    """One aiohttp session for both servers; every failure becomes a ProbeError."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None) -> None:
        self._session = session
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def call(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of GET (no body) or POST; raises ProbeError unless it is a 200."""
        status, payload = await self.fetch(url, path, body)
        if status != 200:
            snippet = payload[:_ERROR_SNIPPET_CHARS].decode("utf-8", "replace")
            raise ProbeError(f"{url}{path} answered HTTP {status}: {snippet}")
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise ProbeError(f"{url}{path} answered with something that is not JSON") from None

    async def fetch(
        self, url: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, bytes]:
        method = "GET" if body is None else "POST"
        data = None if body is None else orjson.dumps(body)
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._session.request(
                method, url + path, data=data, headers=headers
            ) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise ProbeError(f"{url}{path}: {type(e).__name__}: {e}") from None


class ScoringServer:
    """One server, spoken to in token ids; a subclass per engine API."""

    kind = ""

    def __init__(self, http: Http, url: str, model: str | None) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.model = model

    def _with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        return body if self.model is None else {"model": self.model, **body}

    async def render(self, messages: Sequence[Message]) -> list[int]:
        raise NotImplementedError

    async def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        raise NotImplementedError

    async def score(self, prompt: list[int], cont: list[int], top_k: int) -> list[Position]:
        raise NotImplementedError

    async def decode(self, prompt: list[int], max_tokens: int, top_k: int) -> list[Position]:
        """Continue greedily and return, per generated token, the top-k the server's decode
        step saw (its decode path: what a run's answers come from)."""
        raise NotImplementedError

    def _bad(self, what: str) -> ProbeError:
        return ProbeError(f"{self.url} ({self.kind}): {what}")


# Neutralise sampling defaults a server may take from generation_config.json, so that
# "greedy" means argmax of the model's own distribution on both servers.
NO_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def first_choice(reply: Any, engine: ScoringServer) -> dict[str, Any]:
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise engine._bad("the answer has no choices") from None
    if not isinstance(choice, dict):
        raise engine._bad("choices[0] is not an object")
    return choice


def int_list(value: Any, engine: ScoringServer, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise engine._bad(f"{what} missing or not a list of token ids")
    return value



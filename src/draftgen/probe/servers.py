"""What the A/B probe asks of a server, per engine: render, continue greedily, score.

All of it in token ids: a chat prompt is rendered to ids once, then every request sends
ids, so two servers are compared on exactly the same input. vLLM: `/tokenize` renders,
`/v1/completions` continues (`return_token_ids`) and scores (`prompt_logprobs`). SGLang:
the chat endpoint renders (`return_prompt_token_ids`, 0.5.13+), native `/generate`
continues and scores (`max_new_tokens: 0`, `logprob_start_len`, `top_logprobs_num`).
"""

from __future__ import annotations

import contextlib
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

    def _bad(self, what: str) -> ProbeError:
        return ProbeError(f"{self.url} ({self.kind}): {what}")


# Neutralise sampling defaults a server may take from generation_config.json, so that
# "greedy" means argmax of the model's own distribution on both servers.
_NO_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class VllmServer(ScoringServer):
    kind = "vllm"

    async def render(self, messages: Sequence[Message]) -> list[int]:
        body = {"messages": list(messages), "add_generation_prompt": True}
        reply = await self.http.call(self.url, "/tokenize", self._with_model(body))
        return _int_list(reply.get("tokens") if isinstance(reply, dict) else None, self, "tokens")

    async def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **_NO_PENALTIES}
        choice = _first_choice(await self.http.call(self.url, "/v1/completions",
                                                    self._with_model(body)), self)
        # `return_token_ids` is vLLM >= 0.10; without it the tokens cannot be told apart.
        return _int_list(choice.get("token_ids"), self, "choices[0].token_ids")

    async def score(self, prompt: list[int], cont: list[int], top_k: int) -> list[Position]:
        # vLLM has no start offset for prompt logprobs: it returns the top-k for the whole
        # prompt too, which costs time and bytes with long prompts. max_tokens 0 would
        # need echo; the one extra generated token is cheaper than the echoed text.
        body = {"prompt": prompt + cont, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": top_k}
        choice = _first_choice(await self.http.call(self.url, "/v1/completions",
                                                    self._with_model(body)), self)
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(prompt) + len(cont):
            raise self._bad("prompt_logprobs missing or not one entry per prompt token")
        return [self._position(e, t, top_k) for e, t in zip(entries[len(prompt):], cont,
                                                             strict=True)]

    def _position(self, entry: Any, token: int, top_k: int) -> Position:
        # {"<id>": {"logprob", "rank", "decoded_token"}}: the top-k by rank, plus the
        # prompt token itself whatever its rank.
        try:
            ranked = {int(t): (float(v["logprob"]), int(v["rank"])) for t, v in entry.items()}
            logprob = ranked[token][0]
        except (AttributeError, KeyError, TypeError, ValueError):
            raise self._bad(f"no logprob for token {token} in {entry!r:.200}") from None
        top = {t: lp for t, (lp, rank) in ranked.items() if rank <= top_k}
        top1 = min(ranked, key=lambda t: (ranked[t][1], -ranked[t][0]))
        return Position(token, logprob, top1, top)


class SglangServer(ScoringServer):
    kind = "sglang"

    async def render(self, messages: Sequence[Message]) -> list[int]:
        # SGLang >= 0.5.13 reports the ids its chat template produced; /v1/tokenize only
        # encodes plain text, so older versions cannot render a chat prompt to ids.
        body = {"messages": list(messages), "max_tokens": 1, "temperature": 0.0,
                "return_prompt_token_ids": True, "return_meta_info": True}
        reply = await self.http.call(self.url, "/v1/chat/completions", self._with_model(body))
        choice = _first_choice(reply, self)
        ids = choice.get("prompt_token_ids") or reply.get("prompt_token_ids")
        if ids is None:
            raise self._bad("the chat answer has no prompt_token_ids (needs SGLang >= 0.5.13, "
                            "or probe with a vLLM reference)")
        return _int_list(ids, self, "prompt_token_ids")

    async def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                    **_NO_PENALTIES}}
        reply = await self.http.call(self.url, "/generate", body)
        if isinstance(reply, dict) and isinstance(reply.get("output_ids"), list):
            return _int_list(reply["output_ids"], self, "output_ids")
        # Older versions: the ids only travel inside the logprob triples.
        entries = _meta(reply, self).get("output_token_logprobs")
        if not isinstance(entries, list):
            raise self._bad("/generate answered without output_ids or output_token_logprobs")
        return [_triple(e, self)[1] for e in entries]

    async def score(self, prompt: list[int], cont: list[int], top_k: int) -> list[Position]:
        if not cont:
            return []
        # Logprobs are returned for tokens input_ids[start:], the first one None (it has no
        # logits before it), so start one token before the continuation. Older versions
        # drop that None; reading the last len(cont) entries fits both.
        body = {"input_ids": prompt + cont, "return_logprob": True,
                "logprob_start_len": len(prompt) - 1, "top_logprobs_num": top_k,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}
        meta = _meta(await self.http.call(self.url, "/generate", body), self)
        tokens, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
        if not (isinstance(tokens, list) and isinstance(tops, list)
                and len(tokens) >= len(cont) and len(tops) >= len(cont)):
            raise self._bad("/generate answered without input logprobs for the continuation")
        out = []
        for entry, top_entry, token in zip(tokens[-len(cont):], tops[-len(cont):], cont,
                                           strict=True):
            logprob, tid = _triple(entry, self)
            if tid != token:
                raise self._bad(f"input logprobs are for token {tid}, expected {token}")
            if not isinstance(top_entry, list) or not top_entry:
                raise self._bad("input_top_logprobs has no entry for a continuation token")
            top = dict(_triple(e, self)[::-1] for e in top_entry)
            out.append(Position(token, logprob, max(top, key=top.__getitem__), top))
        return out


def _first_choice(reply: Any, engine: ScoringServer) -> dict[str, Any]:
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise engine._bad("the answer has no choices") from None
    if not isinstance(choice, dict):
        raise engine._bad("choices[0] is not an object")
    return choice


def _meta(reply: Any, engine: ScoringServer) -> dict[str, Any]:
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict):
        raise engine._bad("/generate answered without meta_info")
    return meta


def _triple(entry: Any, engine: ScoringServer) -> tuple[float, int]:
    """SGLang's [logprob, token_id, text-or-null]."""
    try:
        return float(entry[0]), int(entry[1])
    except (IndexError, TypeError, ValueError):
        raise engine._bad(f"a logprob entry is not [logprob, id, text]: {entry!r:.100}") from None


def _int_list(value: Any, engine: ScoringServer, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise engine._bad(f"{what} missing or not a list of token ids")
    return value


async def connect(http: Http, url: str, model: str | None) -> ScoringServer:
    """SGLang answers /get_model_info; vLLM does not, and names its model at /v1/models."""
    url = url.rstrip("/")
    status, payload = await http.fetch(url, "/get_model_info")
    info: Any = None
    with contextlib.suppress(orjson.JSONDecodeError):
        info = orjson.loads(payload) if status == 200 else None
    if isinstance(info, dict) and "model_path" in info:
        return SglangServer(http, url, model)
    if model is None:
        models = await http.call(url, "/v1/models")
        with contextlib.suppress(KeyError, IndexError, TypeError):
            model = str(models["data"][0]["id"])
    return VllmServer(http, url, model)

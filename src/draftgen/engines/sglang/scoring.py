"""The probe on SGLang: the chat endpoint renders (`return_prompt_token_ids`, 0.5.13+),
native `/generate` continues and scores (`max_new_tokens: 0`, `logprob_start_len`,
`top_logprobs_num`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftgen.engines.scoring import (
    NO_PENALTIES,
    Position,
    ScoringServer,
    first_choice,
    int_list,
)
from draftgen.sample import Message


class SglangServer(ScoringServer):
    kind = "sglang"

    async def render(self, messages: Sequence[Message]) -> list[int]:
        # SGLang >= 0.5.13 reports the ids its chat template produced; /v1/tokenize only
        # encodes plain text, so older versions cannot render a chat prompt to ids.
        body = {"messages": list(messages), "max_tokens": 1, "temperature": 0.0,
                "return_prompt_token_ids": True, "return_meta_info": True}
        reply = await self.http.call(self.url, "/v1/chat/completions", self._with_model(body))
        choice = first_choice(reply, self)
        ids = choice.get("prompt_token_ids") or reply.get("prompt_token_ids")
        if ids is None:
            raise self._bad("the chat answer has no prompt_token_ids (needs SGLang >= 0.5.13, "
                            "or probe with a vLLM reference)")
        return int_list(ids, self, "prompt_token_ids")

    async def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                    **NO_PENALTIES}}
        reply = await self.http.call(self.url, "/generate", body)
        if isinstance(reply, dict) and isinstance(reply.get("output_ids"), list):
            return int_list(reply["output_ids"], self, "output_ids")
        # Older versions: the ids only travel inside the logprob triples.
        entries = _meta(reply, self).get("output_token_logprobs")
        if not isinstance(entries, list):
            raise self._bad("/generate answered without output_ids or output_token_logprobs")
        return [_triple(e, self)[1] for e in entries]

    async def decode(self, prompt: list[int], max_tokens: int, top_k: int) -> list[Position]:
        body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": top_k,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                    **NO_PENALTIES}}
        meta = _meta(await self.http.call(self.url, "/generate", body), self)
        tokens, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if not (isinstance(tokens, list) and isinstance(tops, list)
                and len(tokens) == len(tops)):
            raise self._bad("/generate answered without output logprobs (top_logprobs_num)")
        out = []
        for entry, top_entry in zip(tokens, tops, strict=True):
            logprob, token = _triple(entry, self)
            if not isinstance(top_entry, list) or not top_entry:
                raise self._bad("output_top_logprobs has no entry for a generated token")
            top = dict(_triple(e, self)[::-1] for e in top_entry)
            out.append(Position(token, logprob, max(top, key=top.__getitem__), top))
        return out

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

"""The probe on vLLM: `/tokenize` renders, `/v1/completions` continues (`return_token_ids`)
and scores (`prompt_logprobs`)."""

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


class VllmServer(ScoringServer):
    kind = "vllm"

    async def render(self, messages: Sequence[Message]) -> list[int]:
        body = {"messages": list(messages), "add_generation_prompt": True}
        reply = await self.http.call(self.url, "/tokenize", self._with_model(body))
        return int_list(reply.get("tokens") if isinstance(reply, dict) else None, self, "tokens")

    async def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **NO_PENALTIES}
        choice = first_choice(await self.http.call(self.url, "/v1/completions",
                                                    self._with_model(body)), self)
        # `return_token_ids` is vLLM >= 0.10; without it the tokens cannot be told apart.
        return int_list(choice.get("token_ids"), self, "choices[0].token_ids")

    async def score(self, prompt: list[int], cont: list[int], top_k: int) -> list[Position]:
        # vLLM has no start offset for prompt logprobs: it returns the top-k for the whole
        # prompt too, which costs time and bytes with long prompts. max_tokens 0 would
        # need echo; the one extra generated token is cheaper than the echoed text.
        body = {"prompt": prompt + cont, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": top_k}
        choice = first_choice(await self.http.call(self.url, "/v1/completions",
                                                    self._with_model(body)), self)
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(prompt) + len(cont):
            raise self._bad("prompt_logprobs missing or not one entry per prompt token")
        return [self._position(e, t, top_k) for e, t in zip(entries[len(prompt):], cont,
                                                             strict=True)]

    async def decode(self, prompt: list[int], max_tokens: int, top_k: int) -> list[Position]:
        # Token ids, not strings, in the logprobs: "token_id:<id>" keys.
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": top_k, "return_tokens_as_token_ids": True,
                "return_token_ids": True, **NO_PENALTIES}
        choice = first_choice(await self.http.call(self.url, "/v1/completions",
                                                    self._with_model(body)), self)
        ids = int_list(choice.get("token_ids"), self, "choices[0].token_ids")
        logprobs = choice.get("logprobs")
        chosen = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        if not (isinstance(chosen, list) and isinstance(tops, list)
                and len(chosen) == len(tops) == len(ids)):
            raise self._bad("the completion has no per-token logprobs (logprobs: top_k)")
        out = []
        for token, logprob, top in zip(ids, chosen, tops, strict=True):
            try:
                ranked = {int(str(k).rsplit(":", 1)[1]): float(v) for k, v in top.items()}
                lp = float(logprob)
            except (AttributeError, IndexError, TypeError, ValueError):
                raise self._bad(f"a top-logprobs entry is not token_id:<id> keyed: "
                                f"{top!r:.120}") from None
            out.append(Position(token, lp, max(ranked, key=ranked.__getitem__), ranked))
        return out

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

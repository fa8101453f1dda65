"""Stand-in servers that answer the probe like vLLM and SGLang, serving one small
deterministic "model" (a next-token distribution computed from the context): two stand-ins
with the same model agree exactly, and one whose logits carry added noise is a candidate with
known, adjustable drift. Each runs on its own event loop in a thread, so the same server
serves async tests and commands that call `asyncio.run` themselves."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

VOCAB = 48
BOS = 1


@dataclass
class FakeModel:
    noise: float = 0.0  # standard deviation of the noise added to each logit
    # Noise only where tokens are generated: a server whose prefill scores exactly but whose
    # decode step differs (a lossy KV cache its prefill never reads, say).
    decode_noise: float = 0.0

    def logprobs(self, context: Sequence[int], *, decoding: bool = False) -> list[float]:
        key = f"{context[-1]}-{context[-2] if len(context) > 1 else -1}-{len(context) % 5}"
        rng = random.Random(key)
        logits = [rng.gauss(0.0, 2.5) for _ in range(VOCAB)]
        for amount, salt in ((self.noise, "noise"),
                             (self.decode_noise if decoding else 0.0, "decode")):
            if amount:
                jitter = random.Random(salt + key)
                logits = [x + amount * jitter.gauss(0.0, 1.0) for x in logits]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    def decode(self, prompt: Sequence[int], n: int) -> list[tuple[int, list[float]]]:
        """Greedy generation: each token with the distribution it was chosen from."""
        ids, out = list(prompt), []
        for _ in range(n):
            lps = self.logprobs(ids, decoding=True)
            token = max(range(VOCAB), key=lps.__getitem__)
            out.append((token, lps))
            ids.append(token)
        return out

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        return [t for t, _ in self.decode(prompt, n)]


def render(messages: Sequence[dict[str, str]]) -> list[int]:
    text = "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:"
    return [BOS] + [3 + ord(c) % (VOCAB - 3) for c in text]


def ranked(lps: list[float]) -> list[int]:
    return sorted(range(VOCAB), key=lambda t: -lps[t])


@dataclass
class StandIn:
    """A server of one flavour: "vllm", "sglang", or "sglang-old" (no output_ids)."""

    flavour: str
    model: FakeModel = field(default_factory=FakeModel)
    # A decode that returns no logprobs (as some engines under speculative decoding).
    no_decode_logprobs: bool = False
    seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        if self.flavour == "vllm":
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_post("/v1/completions", self._completions)
        else:
            app.router.add_get("/get_model_info", self._model_info)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/generate", self._generate)
        return app

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        self.seen.append((request.path, body | {"_auth": request.headers.get("Authorization")}))
        return body

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 4096}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids = render(body["messages"])
        return web.json_response({"count": len(ids), "tokens": ids, "token_strs": None})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        prompt: list[int] = body["prompt"]
        k = body.get("prompt_logprobs")
        if k is not None and k > 20:  # vLLM's default --max-logprobs
            return web.json_response(
                {"error": {"message": "Requested prompt logprobs of 32, which is greater "
                           "than max allowed: 20", "code": 400}}, status=400)
        choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length"}
        steps = self.model.decode(prompt, body.get("max_tokens", 16))
        out = [t for t, _ in steps]
        if body.get("return_token_ids"):
            choice["token_ids"] = out
        if body.get("logprobs") is not None and not self.no_decode_logprobs:
            n = body["logprobs"]
            name = ((lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids")
                    else (lambda t: f"<{t}>"))
            choice["logprobs"] = {
                "tokens": [name(t) for t in out],
                "token_logprobs": [lps[t] for t, lps in steps],
                "top_logprobs": [{name(u): lps[u] for u in {*ranked(lps)[:n], t}}
                                 for t, lps in steps]}
        if k is not None:
            entries: list[Any] = [None]
            for i in range(1, len(prompt)):
                lps = self.model.logprobs(prompt[:i])
                order = ranked(lps)
                keep = {*order[:k], prompt[i]}
                entries.append({str(t): {"logprob": lps[t], "rank": order.index(t) + 1,
                                         "decoded_token": ""} for t in keep})
            choice["prompt_logprobs"] = entries
        return web.json_response({"object": "text_completion", "choices": [choice]})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/fake", "is_generation": True})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = render(body["messages"])
        return web.json_response({"choices": [choice]})

    async def _generate(self, request: web.Request) -> web.Response:
        # SGLang's scheduler: logprobs for tokens input_ids[start:], the first None and the
        # rest shifted by one (the logits at i predict token i + 1); triples [lp, id, text].
        body = await self._body(request)
        ids: list[int] = body["input_ids"]
        params = body["sampling_params"]
        steps = self.model.decode(ids, params["max_new_tokens"])
        out = [t for t, _ in steps]
        meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", -1)
            k = body.get("top_logprobs_num", 0)
            span = range(start, len(ids)) if start >= 0 else range(0)
            tokens: list[Any] = []
            tops: list[Any] = []
            for pos in span:
                if pos == start:
                    tokens.append([None, ids[pos], None])
                    tops.append(None)
                    continue
                lps = self.model.logprobs(ids[:pos])
                tokens.append([lps[ids[pos]], ids[pos], None])
                tops.append([[lps[t], t, None] for t in ranked(lps)[:k]])
            meta |= {"input_token_logprobs": tokens, "input_top_logprobs": tops}
            if not self.no_decode_logprobs:
                meta["output_token_logprobs"] = [[lps[t], t, None] for t, lps in steps]
                meta["output_top_logprobs"] = [[[lps[u], u, None] for u in ranked(lps)[:k]]
                                               for _, lps in steps]
        reply: dict[str, Any] = {"text": "", "meta_info": meta}
        if self.flavour == "sglang":
            reply["output_ids"] = out
        return web.json_response(reply)

    def requests(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.seen if p == path]


@contextmanager
def serving(*servers: StandIn) -> Iterator[None]:
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []

    async def start() -> None:
        for s in servers:
            runner = web.AppRunner(s.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            s.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def stop() -> None:
        for r in runners:
            await r.cleanup()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


PROMPTS = [[{"role": "user", "content": f"question number {i}: {'why ' * (i % 4)}?"}]
           for i in range(12)]

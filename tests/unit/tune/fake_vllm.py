"""A fake vLLM for the tune's unit tests, launched as a real process by the launcher: the
profile's `python` is a script that runs `main` here, so the tune starts it with vLLM's own
argv, waits for it, verifies it, probes it and measures a window on it over HTTP.

- `-c PROBE ...` (draftgen's install probe): answers as a Python with vLLM FAKE_VERSION
  (default 0.0.1) installed, flags unknown.
- `-m vllm.entrypoints.openai.api_server FLAGS`: serves on `--port`. With `--api-key K`
  (or VLLM_API_KEY in its environment) every route answers 401 unless the request carries
  `Authorization: Bearer K`; the 401 quotes the header it got, as a careless proxy would.
- `GET /metrics` (`vllm:cache_config_info` with FAKE_KV_TOKENS, default 65536, and the
  load gauges), `/version`, `/v1/models`; `POST /tokenize` and `/v1/completions` (the
  probe: the scoring stand-in's model); `POST /v1/chat/completions`, plain (readiness) or
  streamed: 8 tokens, FAKE_TOKEN_S (default 0.01) seconds apart, at most `--max-num-seqs`
  streams at once.
- FAKE_FAIL=SEQS:N: launched with `--max-num-seqs SEQS`, every N-th streamed chat fails
  with HTTP 500.

It writes nothing of its argv or environment to its log: what the key test finds in
server.log is what draftgen wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from aiohttp import web

from helpers.fakeserver import chunk, sse, usage
from helpers.scoring_standin import StandIn

ANSWER_TOKENS = 8


def _probe() -> None:
    version = os.environ.get("FAKE_VERSION", "0.0.1")
    print(json.dumps({"version": version, "flags": None, "dist": "vllm"}), flush=True)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--served-model-name", default="fake")
    args, _ = parser.parse_known_args(argv)
    return args


def make_app(args: argparse.Namespace) -> web.Application:
    key = args.api_key or os.environ.get("VLLM_API_KEY")
    kv_tokens = int(os.environ.get("FAKE_KV_TOKENS", "65536"))
    token_s = float(os.environ.get("FAKE_TOKEN_S", "0.01"))
    fail_seqs, _, fail_every = os.environ.get("FAKE_FAIL", "0:0").partition(":")
    failing = int(fail_seqs) == args.max_num_seqs and int(fail_every) > 0
    slots = asyncio.Semaphore(args.max_num_seqs)
    state = {"running": 0, "waiting": 0, "streams": 0}

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        got = request.headers.get("Authorization")
        if key is not None and got != f"Bearer {key}":
            return web.json_response(
                {"error": {"message": f"Unauthorized: got Authorization: {got}",
                           "type": "Unauthorized", "code": 401}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    scoring = StandIn("vllm")
    app = web.Application(middlewares=[auth])
    app.router.add_get("/v1/models", scoring._models)
    app.router.add_post("/tokenize", scoring._tokenize)
    app.router.add_post("/v1/completions", scoring._completions)

    async def metrics(request: web.Request) -> web.Response:
        labels = (f'engine="0",cache_dtype="bfloat16",block_size="16",'
                  f'kv_cache_size_tokens="{kv_tokens}",gpu_memory_utilization="0.9"')
        used = min(1.0, state["running"] * 64 / kv_tokens)
        text = (
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{labels}}} 1.0\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0"}} {state["running"]}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0"}} {state["waiting"]}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0"}} {used}\n'
            "# TYPE vllm:num_preemptions_total counter\n"
            'vllm:num_preemptions_total{engine="0"} 0.0\n')
        return web.Response(text=text)

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": os.environ.get("FAKE_VERSION", "0.0.1")})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": "x"}, "finish_reason": "length"}]})
        state["streams"] += 1
        if failing and state["streams"] % int(fail_every) == 0:
            return web.json_response({"error": {"message": "fake engine error",
                                                "code": 500}}, status=500)
        n = min(ANSWER_TOKENS, int(body.get("max_tokens") or ANSWER_TOKENS))
        state["waiting"] += 1
        async with slots:
            state["waiting"] -= 1
            state["running"] += 1
            try:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(chunk("", role="assistant"))
                for i in range(n):
                    await asyncio.sleep(token_s)
                    await response.write(sse({
                        "id": "chatcmpl-1", "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": "tok "},
                                     "finish_reason": None}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": i + 1,
                                  "total_tokens": 6 + i}}))
                await response.write(chunk(finish="length"))
                await response.write(usage(5, n))
                await response.write(b"data: [DONE]\n\n")
                return response
            finally:
                state["running"] -= 1

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main(argv: list[str]) -> None:
    if argv[:1] == ["-c"]:
        _probe()
        return
    args = _args(argv[2:] if argv[:1] == ["-m"] else argv)

    async def serve() -> None:
        runner = web.AppRunner(make_app(args), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print(f"fake vllm: serving on port {args.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1:])

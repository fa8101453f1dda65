"""The chat request draftgen POSTs, checked against each engine's own request handling.

The exact JSON `ChatClient.chat` sends (captured by a stand-in server on 127.0.0.1) for a
body built the way the runner builds it (`sample.request_body(sample, sample.base_body(
model, sampling), messages)` plus the engine's `token_id_fields`) is validated by:
  * SGLang 0.5.23 and 0.5.9: `ChatCompletionRequest` of sglang/srt/entrypoints/openai/
    protocol.py, `OpenAIServingChat._validate_request`, and on 0.5.23 the checks in
    `_convert_to_internal_request` that answer HTTP 400 (e.g. return_token_ids with stream);
  * vLLM: `ChatCompletionRequest` of vllm.entrypoints.openai.chat_completion.protocol.
Both SGLang releases ignore unknown fields silently (pydantic extra="ignore"), so the set
of fields each drops is pinned: a new silent drop fails here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web
from conftest import Oracle

from draftgen.client import ChatClient
from draftgen.client.context import prompt_tokens
from draftgen.engines.registry import engine_for
from draftgen.job import Sampling
from draftgen.sample import Sample, base_body, request_body

MODEL = "kimi-k2.5"
SAMPLING = Sampling(
    temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, presence_penalty=0.5,
    repetition_penalty=1.05, seed=7, extra_body={"chat_template_kwargs": {"thinking": True}},
)
SAMPLE = Sample(
    id="s-1", category="code", partition="long",
    messages=({"role": "system", "content": "You are terse."},
              {"role": "user", "content": "Write a haiku about KV caches."}),
    max_tokens=2048, seed=1234,
)
# What SGLang 0.5.9 has no field for: it drops them and the ids just do not come.
DROPPED_BY_059 = sorted(engine_for("sglang").token_id_fields)
SSE_REPLY = b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in [
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                  "finish_reason": None}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
     "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                              "total_tokens": 13}},
]) + b"data: [DONE]\n\n"


def runner_body(engine: str) -> dict[str, Any]:
    """The body the runner hands `ChatClient.chat` for one sample to this engine."""
    base = base_body(MODEL, SAMPLING.model_dump())
    body = request_body(SAMPLE, base, list(SAMPLE.messages))
    return {**body, **engine_for(engine).token_id_fields}


@pytest.fixture
async def capture_server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(orjson.loads(await request.read()))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE_REPLY)
        await response.write_eof()
        return response

    async with serving("/v1/chat/completions", chat) as url:
        yield url, seen


@asynccontextmanager
async def serving(path: str, handler: Any, *more: tuple[str, Any]) -> AsyncIterator[str]:
    """POST `path` answered by `handler` (and each of `more`) on 127.0.0.1; the base URL."""
    app = web.Application()
    for route, answer in ((path, handler), *more):
        app.router.add_post(route, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def sent_body(engine: str, server: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The JSON that went over the wire."""
    url, seen = server
    async with ChatClient() as client:
        done = await client.chat(url, runner_body(engine))
    assert done.content == "ok" and done.finish_reason == "stop"
    assert len(seen) == 1
    return seen[0]


@pytest.fixture
async def sglang_body(capture_server: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return await sent_body("sglang", capture_server)


@pytest.fixture
async def vllm_body(capture_server: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return await sent_body("vllm", capture_server)


def test_sent_body_is_the_runner_body_streamed(sglang_body: dict[str, Any]) -> None:
    """What the engines are asked about below is what the runner means to send."""
    assert sglang_body["stream"] is True
    assert sglang_body["stream_options"]["include_usage"] is True
    assert sglang_body["messages"] == list(SAMPLE.messages)
    assert sglang_body["seed"] == SAMPLE.seed and sglang_body["max_tokens"] == SAMPLE.max_tokens
    assert sglang_body["chat_template_kwargs"] == {"thinking": True}
    assert {k: sglang_body[k] for k in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05}


async def test_sglang_accepts_the_body(sglang_oracle: Oracle,
                                       sglang_body: dict[str, Any]) -> None:
    version = sglang_oracle.version
    checked = sglang_oracle.ask("validate_chat", body=sglang_body)
    assert checked["ok"], f"SGLang {version} answers 400: {checked['error']}"
    expected = DROPPED_BY_059 if version == "0.5.9" else []
    assert checked["dropped"] == expected, f"SGLang {version} silently ignores these fields"
    nested = [p for p in checked["dropped_paths"] if "." in p]
    assert nested == [], f"SGLang {version} silently ignores nested fields"


def test_sglang_body_has_no_streaming_token_id_field_that_0523_refuses(
    sglang_body: dict[str, Any],
) -> None:
    # 0.5.23 answers 400 to these with stream=true (serving_chat.py); vLLM's name too.
    for key in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
        assert key not in sglang_body
    assert not set(engine_for("vllm").token_id_fields) & set(sglang_body)


async def test_sglang_0523_refuses_return_token_ids_with_stream(
    sglang_oracles: dict[str, Oracle], sglang_body: dict[str, Any],
) -> None:
    """The check the test above guards against is live in the oracle."""
    checked = sglang_oracles["0.5.23"].ask(
        "validate_chat", body={**sglang_body, "return_token_ids": True})
    assert not checked["ok"] and checked["stage"] == "convert"
    assert "return_token_ids is not supported with streaming" in checked["error"]


async def test_vllm_accepts_the_body(vllm_oracle: Oracle, vllm_body: dict[str, Any]) -> None:
    checked = vllm_oracle.ask("validate_chat", body=vllm_body)
    assert checked["ok"], f"vLLM refuses: {checked['error']}"
    # vLLM keeps unknown fields in model_extra (extra="allow") and reads none of them.
    assert checked["dropped_paths"] == [], "fields vLLM does not know"
    assert vllm_body["return_token_ids"] is True
    assert not set(engine_for("sglang").token_id_fields) & set(vllm_body)


async def tokenize_bodies(refuse_messages: bool, chat_status: int = 200
                          ) -> tuple[int | None, list[dict[str, Any]]]:
    """What `client.context.prompt_tokens` POSTs (to /tokenize, then a one-token chat
    completion where no /tokenize counts the template), and the count it makes of the
    answers: a server that refuses a `messages` body (422, as SGLang 0.5.9's model does) is
    asked again with text, and then for a completion, whose usage gives 31."""
    seen: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        seen.append(body)
        if refuse_messages and "messages" in body:
            return web.Response(status=422, body=b'{"detail": "prompt: field required"}')
        return web.json_response({"tokens": [1] * 20, "count": 20, "max_model_len": 4096})

    async def chat(request: web.Request) -> web.Response:
        seen.append(orjson.loads(await request.read()))
        return web.json_response(
            {"id": "c1", "object": "chat.completion", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                          "finish_reason": "length"}],
             "usage": {"prompt_tokens": 31, "completion_tokens": 1, "total_tokens": 32}},
            status=chat_status)

    async with serving("/tokenize", tokenize, ("/v1/chat/completions", chat)) as url, \
            ChatClient() as client:
        n = await prompt_tokens(client, url, MODEL, SAMPLE.messages)
    return n, seen


async def test_prompt_counts_are_asked_the_way_each_engine_reads_them(
    sglang_oracle: Oracle, vllm_oracle: Oracle,
) -> None:
    """vLLM and SGLang 0.5.23 take the chat messages (the count the server will see, its
    template included); SGLang 0.5.9 refuses them and counts text only, so the count is a
    one-token chat completion's usage, a body each release takes; only where that fails
    too is it the text plus an allowance per message. No field is silently ignored."""
    n, [chat] = await tokenize_bodies(refuse_messages=False)
    assert n == 20 and chat["messages"] == list(SAMPLE.messages)
    checked = vllm_oracle.ask("validate_tokenize", body=chat)
    assert checked["ok"] and checked["kind"] == "TokenizeChatRequest", checked
    assert checked["dropped"] == []
    checked = sglang_oracle.ask("validate_tokenize", body=chat)
    if sglang_oracle.version == "0.5.9":
        assert not checked["ok"], "0.5.9 takes messages now: the text fallback is not needed"
        n, [_, text, one] = await tokenize_bodies(refuse_messages=True)
        assert n == 31 and one["messages"] == list(SAMPLE.messages) and one["max_tokens"] == 1
        for oracle in (sglang_oracle, vllm_oracle):
            taken = oracle.ask("validate_chat", body=one)
            assert taken["ok"] and taken["dropped_paths"] == [], taken
        n, _ = await tokenize_bodies(refuse_messages=True, chat_status=500)
        assert n is not None and n > 20  # the template's allowance per message is added
        checked = sglang_oracle.ask("validate_tokenize", body=text)
    assert checked["ok"], f"SGLang {sglang_oracle.version}: {checked['error']}"
    assert checked["dropped"] == []

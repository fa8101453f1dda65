"""A prompt's length by the server's own count, where its /tokenize cannot apply the
template: a one-token chat completion's usage, or its refusal's words."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web
from test_classify import CONTEXT_MESSAGES

from draftgen.client import ChatClient
from draftgen.client.context import prompt_tokens, refusal_counts
from draftgen.errors import RequestError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
# SGLang's words for a prompt over the context (0.5.9 and 0.5.23), and vLLM 0.32's.
SGLANG_TOO_LONG = ("The input (5000 tokens) is longer than the model's context length "
                   "(4096 tokens).")
VLLM_TOO_LONG = "Input length (5001) exceeds model's maximum context length (4096)."


Answer = Callable[[dict[str, Any]], web.Response]  # a request body -> its answer
bodies: list[dict[str, Any]] = []  # what the last server was sent, in order


@asynccontextmanager
async def server(tokenize: Answer | None, chat: Answer | None
                 ) -> AsyncIterator[tuple[str, list[str]]]:
    """/tokenize and /v1/chat/completions answering as given (None: no such route); the
    base URL and the paths asked, in order."""
    asked: list[str] = []
    bodies.clear()

    def route(path: str, answer: Answer) -> Any:
        async def handle(request: web.Request) -> web.Response:
            body = orjson.loads(await request.read())
            asked.append(path)
            bodies.append(body)
            if path == "/v1/chat/completions" and answer is slow:
                await asyncio.sleep(1.0)  # past the 0.3 s the tests allow
            return answer(body)
        return handle

    app = web.Application()
    for path, answer in (("/tokenize", tokenize), ("/v1/chat/completions", chat)):
        if answer is not None:
            app.router.add_post(path, route(path, answer))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", asked
    finally:
        await runner.cleanup()


def answer(obj: dict[str, Any], status: int = 200) -> Answer:
    return lambda _body: web.json_response(obj, status=status)


def usage(n: int) -> Answer:
    return answer({"choices": [{"index": 0, "message": {"content": "x"},
                                "finish_reason": "length"}],
                   "usage": {"prompt_tokens": n, "completion_tokens": 1}})


def text_only(body: dict[str, Any]) -> web.Response:
    """SGLang 0.5.9's /tokenize: no messages, a text's count (without the template)."""
    if "messages" in body:
        return web.json_response({"detail": "prompt: field required"}, status=422)
    return web.json_response({"count": 20})


async def count(tokenize: Answer | None, chat: Answer | None, timeout_s: float = 30.0
                ) -> tuple[int | None, list[str]]:
    async with server(tokenize, chat) as (url, asked), ChatClient() as client:
        n = await prompt_tokens(client, url, "m", MESSAGES, timeout_s=timeout_s)
    for path, body in zip(asked, bodies, strict=True):
        if path == "/v1/chat/completions":  # one token of the prompt as it is
            assert body["max_tokens"] == 1 and body["messages"] == MESSAGES
    return n, asked


def slow(_body: dict[str, Any]) -> web.Response:
    """Answers only after the client gave up (the server delays it)."""
    return web.json_response({"detail": "late"})


async def test_a_template_applying_tokenize_is_enough() -> None:
    n, asked = await count(answer({"count": 17}), usage(99))
    assert (n, asked) == (17, ["/tokenize"])


@pytest.mark.parametrize(("tokenize", "chat", "expected"), [
    # SGLang 0.5.9: messages refused, text counted without the template: the completion
    # says what the server reads.
    (text_only, usage(31), 31),
    # No /tokenize at all (a gateway, say): the completion alone.
    (None, usage(31), 31),
    # The prompt is over the context: the refusal's words carry its length.
    (text_only, answer({"object": "error", "message": SGLANG_TOO_LONG, "code": 400}, 400),
     5000),
    (None, answer({"error": {"message": VLLM_TOO_LONG, "code": 400}}, 400), 5001),
])
async def test_where_tokenize_counts_no_template_a_one_token_completion_does(
    tokenize: Answer | None, chat: Answer, expected: int,
) -> None:
    n, asked = await count(tokenize, chat)
    assert n == expected
    assert asked[-1] == "/v1/chat/completions"


async def test_the_text_count_and_an_allowance_only_when_nothing_exact_answers() -> None:
    # /tokenize takes only text (20 tokens), the completion fails: the estimate.
    n, asked = await count(text_only, answer({"detail": "busy"}, 503))
    assert n is not None and n > 20
    assert asked == ["/tokenize", "/tokenize", "/v1/chat/completions"]
    # A completion that times out (a busy server): the estimate stands; without one, the
    # error is the caller's to weigh.
    n, _ = await count(text_only, slow, timeout_s=0.3)
    assert n is not None and n > 20
    with pytest.raises(RequestError):
        await count(None, slow, timeout_s=0.3)
    # Nothing answers a count at all: none.
    assert await count(None, answer({"detail": "no"}, 404)) == (None, ["/v1/chat/completions"])


def test_refusal_counts_reads_each_engines_words() -> None:
    assert refusal_counts(SGLANG_TOO_LONG) == (4096, 5000)
    assert refusal_counts(VLLM_TOO_LONG) == (4096, 5001)
    assert refusal_counts("This model's maximum context length is 4096 tokens. However, your "
                          "request has 5002 input tokens. Please reduce the length of the "
                          "input messages.") == (4096, 5002)  # vLLM 0.10-0.11
    assert refusal_counts("Internal server error") is None
    # Every wording the client knows as "context exceeded" that names both numbers.
    read = [refusal_counts(m) for m in CONTEXT_MESSAGES]
    assert read == [(4096, 1000), (4096, 1000), (4096, 9254), (131072, 150000), None,
                    (31994, 31996)]

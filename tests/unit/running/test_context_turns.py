"""The context, turn by turn: a later turn carrying the answers so far is shortened or ends
the chain before it is sent, and a server's "context length exceeded" is the same decision —
never a charged failure where a shorter answer fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from test_runner import last_user, run

from draftgen.reporting.status import read_status
from draftgen.running.context import later_turn_room, room_after_refusal
from helpers.fakeserver import FakeServer, Reply, completion, error_reply

JOB = """
model: fake
sampling: {{temperature: 0.0}}
partitions:
  p: {{max_tokens: 64, concurrency: 2}}
categories:
  - {{name: chat, source: {{path: chat.jsonl, id_field: id}}, partition: p}}
multi_turn: all
over_context: {policy}
client: {{retry: {{max_attempts: 3, backoff_base_s: 0.001, backoff_max_s: 0.002}}}}
progress_interval_s: 1000
"""
CONVERSATION = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "second"}, {"role": "assistant", "content": "y"}]
SGLANG_REFUSAL = ("Requested token count exceeds the model's maximum context length of 100 "
                  "tokens. You requested a total of {total} tokens: 70 tokens from the input "
                  "messages and {asked} tokens for the completion. Please reduce the number "
                  "of tokens in the input messages or the completion to fit within the limit.")


def job_at(tmp_path: Path, policy: str, rows: list[dict[str, Any]]) -> Path:
    (tmp_path / "chat.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(policy=policy))
    return path


def long_first_turn(body: dict[str, Any]) -> Reply:
    # The first answer leaves the conversation at 100 + 40 tokens as the server counts it.
    if last_user(body) == "first":
        return completion(["a long first answer"], prompt_tokens=100, completion_tokens=40)
    return completion(["short"], prompt_tokens=160, completion_tokens=5)


@pytest.mark.parametrize("policy", ["shorten", "set_aside"])
async def test_a_later_turn_that_would_pass_the_context(tmp_path: Path, policy: str) -> None:
    job = job_at(tmp_path, policy, [{"id": "a", "messages": CONVERSATION}])
    async with FakeServer(responder=long_first_turn, context_tokens=200) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (1, 0)
    if policy == "shorten":
        # 200 − (100 + 40 + 16 for the template + 2 for "second") = 42 of the 64 asked.
        assert [s.body["max_tokens"] for s in server.seen] == [64, 42]
    else:
        # Not sent as asked, and not shortened: the chain ends with the turn that fit.
        assert [last_user(s.body) for s in server.seen] == ["first"]


async def test_a_servers_context_refusal_is_shortened_and_sent_again(tmp_path: Path) -> None:
    def sglang(body: dict[str, Any]) -> Reply:
        asked = body["max_tokens"]
        if 70 + asked > 100:
            return error_reply(400, SGLANG_REFUSAL.format(total=70 + asked, asked=asked),
                               nested=False)
        return completion(["fits"], prompt_tokens=70, completion_tokens=4)

    job = job_at(tmp_path, "shorten", [{"id": "a", "messages": CONVERSATION[:1]}])
    async with FakeServer(responder=sglang, context_tokens=100) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (1, 0)
    assert [s.body["max_tokens"] for s in server.seen] == [64, 30]
    assert read_status(tmp_path / "out").failures == {}


async def test_a_first_turn_that_cannot_fit_fails_as_before(tmp_path: Path) -> None:
    def refuse(body: dict[str, Any]) -> Reply:
        return error_reply(400, "This model's maximum context length is 100 tokens. However, "
                                "your prompt contains 130 input tokens, which exceeds this "
                                "limit even without any output tokens.")

    job = job_at(tmp_path, "shorten", [{"id": "a", "messages": CONVERSATION[:1]}])
    async with FakeServer(responder=refuse, context_tokens=100) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (0, 1)
    assert read_status(tmp_path / "out").failures == {"context_too_long": 1}


def test_the_room_each_engine_states() -> None:
    sglang = SGLANG_REFUSAL.format(total=134, asked=64)
    assert room_after_refusal(sglang, None) == 30
    assert room_after_refusal(sglang, 90) == 20  # the run's context, where smaller
    old_vllm = ("This model's maximum context length is 4096 tokens. However, you requested "
                "4200 tokens (3000 in the messages, 1200 in the completion).")
    assert room_after_refusal(old_vllm, None) == 1096
    new_vllm = ("This model's maximum context length is 4096 tokens. However, your prompt "
                "contains at least 4097 input tokens, which exceeds this limit even without "
                "any output tokens.")
    assert room_after_refusal(new_vllm, None) is None
    assert room_after_refusal("The input (5000 tokens) is longer than the model's context "
                              "length (4096 tokens).", None) is None
    assert room_after_refusal("Input length (4200) exceeds model's maximum context length "
                              "(4096).", None) is None
    assert room_after_refusal("context_length_exceeded", None) is None  # says nothing more


def test_a_later_turn_is_reckoned_from_the_servers_usage() -> None:
    class Turn:
        prompt_tokens: int | None = 100
        completion_tokens: int | None = 40

    assert later_turn_room(Turn(), "abcdef", 200) == 200 - (100 + 40 + 16 + 2)
    assert later_turn_room(Turn(), "x", None) is None
    unknown = Turn()
    unknown.prompt_tokens = 0  # no usage reported
    assert later_turn_room(unknown, "x", 200) is None

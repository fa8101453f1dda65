"""Every request fits the context on the real engine, whatever counted its prompt.

- a job `tokenizer:` counts text, not the chat template: near the limit the engine's own
  /tokenize decides, so a prompt it shortens leaves exactly the context;
- a later turn of `multi_turn: all` carries the answers so far, which no plan-time count
  includes: before it is sent it is reckoned from the engine's usage of the turn before;
  one that cannot fit ends its chain with the turns that did (before: the engine refused it
  and the whole sample, first turn included, was a failure);
- a later turn that fits only with a shorter answer is sent with the room reckoned for it
  (every answer held to the token "7", so its length is known). vLLM 0.32 clamps an answer
  that would pass the context by itself, where SGLang refuses it: SGLang's words are tested
  with the server's usage scripted (tests/unit/running/test_context_turns.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
from test_pipeline import draftgen, shard_records

from draftgen.client import ChatClient
from draftgen.client.context import one_token_count
from draftgen.local import LocalEngine
from draftgen.running.context import (
    CHARS_PER_TOKEN_AT_MOST,
    MIN_ANSWER_TOKENS,
    TEMPLATE_TOKENS,
)


def write_job(tmp: Path, url: str, rows: list[dict[str, object]], *, max_tokens: int,
              extra: str = "", bias: str = "", model: str = "tiny") -> Path:
    (tmp / "p.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    job = tmp / "job.yaml"
    job.write_text(f"""
model: {model}
servers: [{url}]
sampling: {{temperature: 0, extra_body: {{ignore_eos: true{bias}}}}}
partitions: {{p: {{max_tokens: {max_tokens}, concurrency: 2}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
output: out
progress_interval_s: 1
{extra}""")
    return job


def settled_at_the_limit(job: Path, out: Path, *, asked: int, context: int) -> dict[str, Any]:
    """Run a one-sample job whose prompt and `asked` answer pass `context` only with the
    template's tokens: the engine's count settles it, so the answer is sent with exactly the
    room left and runs to it. The sample's record."""
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "1/1 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    [planned] = [orjson.loads(x) for x in (out / "plan.jsonl").read_bytes().splitlines()]
    [record] = shard_records(out)
    served_prompt: int = record["turns"][0]["prompt_tokens"]
    assert planned["max_tokens"] < asked
    assert served_prompt + planned["max_tokens"] == context
    assert record["turns"][0]["completion_tokens"] == planned["max_tokens"]
    return record


def test_a_tokenizers_count_near_the_limit_is_settled_by_the_engine(
    local_engine: LocalEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Digits are a token each: 3,480 of them plus a 600-token answer pass 4,096 only with
    # the chat template the job's tokenizer does not count.
    rows: list[dict[str, object]] = [
        {"id": 1, "messages": [{"role": "user", "content": "7" * 3480}]}]
    job = write_job(tmp_path, local_engine.url, rows, max_tokens=610,
                    extra=f"tokenizer: {tiny_model_dir}\n")
    record = settled_at_the_limit(job, tmp_path / "out", asked=610,
                                  context=local_engine.max_model_len)
    # The template's tokens: more than the tokenizer counted.
    assert record["turns"][0]["prompt_tokens"] > 3480 + 4


def test_on_a_real_template_its_default_system_prompt_is_counted_by_the_engine(
    smollm2_engine: LocalEngine, smollm2_dir: Path, tmp_path: Path
) -> None:
    """SmolLM2's template writes a default system prompt (~20 tokens) into a conversation
    that has none, which a job tokenizer's count of the text does not see: 1,700 digits
    (a token each) and a 400-token answer pass its 2,048 positions only with it."""
    rows: list[dict[str, object]] = [
        {"id": 1, "messages": [{"role": "user", "content": "7" * 1700}]}]
    job = write_job(tmp_path, smollm2_engine.url, rows, max_tokens=400, model="smollm2",
                    extra=f"tokenizer: {smollm2_dir}\n")
    record = settled_at_the_limit(job, tmp_path / "out", asked=400,
                                  context=smollm2_engine.max_model_len)
    # The markers and the default system prompt.
    assert record["turns"][0]["prompt_tokens"] >= 1700 + 20
    # The prompt the engine read opens with the template's default system prompt.
    assert record["turns"][0]["prompt_token_ids"][:3] == [1, 9690, 198]  # <|im_start|>system


# A truncated answer ends its chain whatever the room, so a first answer here must stop:
# every token is "7" and 300 of them are a stop string (left out of the text, counted in
# the usage); a later answer shorter than that runs to its max_tokens.
STOPS_AT_300 = f', logit_bias: {{"25": 100}}, stop: ["{"7" * 300}"]'


def chat(second_user_turn: str) -> list[dict[str, object]]:
    return [{"id": 1, "messages": [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": second_user_turn},
        {"role": "assistant", "content": "done"},
    ]}]


def reckoned_room(first: dict[str, Any], user_text: str, context: int) -> int:
    return context - (first["prompt_tokens"] + first["completion_tokens"] + TEMPLATE_TOKENS
                      + math.ceil(len(user_text) / CHARS_PER_TOKEN_AT_MOST))


def test_a_later_turn_that_cannot_fit_ends_the_chain_with_what_did(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    words = " ".join(["way"] * 3000)  # counted as 4,000: with the first turn, over 4,096
    job = write_job(tmp_path, local_engine.url, chat(words), max_tokens=1000,
                    extra="multi_turn: all\nover_context: shorten\n", bias=STOPS_AT_300)
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "1/1 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    [record] = shard_records(tmp_path / "out")
    # The first turn ended on its own; the second had no room: the chain ends, kept.
    [first] = record["turns"]
    assert first["finish_reason"] == "stop" and first["content"] == ""
    assert reckoned_room(first, words, local_engine.max_model_len) < MIN_ANSWER_TOKENS


def test_a_later_turn_is_shortened_to_the_room_its_answers_leave(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    words = " ".join(["way"] * 2700)  # 2,700 tokens, counted as 3,600 (characters / 3)
    job = write_job(tmp_path, local_engine.url, chat(words), max_tokens=1000,
                    extra="multi_turn: all\nover_context: shorten\n", bias=STOPS_AT_300)
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "1/1 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    [record] = shard_records(tmp_path / "out")
    first, second = record["turns"]
    assert first["finish_reason"] == "stop" and first["content"] == ""
    room = reckoned_room(first, words, local_engine.max_model_len)
    assert MIN_ANSWER_TOKENS <= room < 300
    # Sent with the room reckoned for it (1,000 would pass the context) and answered to
    # the end of it, inside the context: the engine did not have to clamp it.
    assert second["prompt_tokens"] >= first["prompt_tokens"] + 2700
    assert second["completion_tokens"] == room
    assert second["finish_reason"] == "length"
    assert second["prompt_tokens"] + room < local_engine.max_model_len


async def test_a_one_token_completion_counts_what_the_template_applying_tokenize_does(
    local_engine: LocalEngine,
) -> None:
    """Where a server's /tokenize counts text only (SGLang 0.5.9) the count is a one-token
    completion's usage: on the real engine it equals its own template-applying /tokenize,
    and a prompt over the context is counted over it from the refusal's words."""
    messages: list[Any] = [{"role": "system", "content": "Answer in one word."},
                           {"role": "user", "content": "7 " * 300},
                           {"role": "assistant", "content": "Seven."},
                           {"role": "user", "content": "And again?"}]
    async with ChatClient() as client:
        status, obj = await client.fetch_json(
            local_engine.url, "/tokenize", {"model": "tiny", "messages": messages},
            timeout_s=30)
        assert status == 200
        counted = await one_token_count(client, local_engine.url, "tiny", messages,
                                        timeout_s=60)
        assert counted == obj["count"] > 300
        too_long = [{"role": "user", "content": "7" * 5000}]
        over = await one_token_count(client, local_engine.url, "tiny", too_long, timeout_s=60)
        # vLLM 0.32 stops counting past the context ("at least 4097 input tokens"): over
        # it, which is all the fit decides (set aside), not the whole 5,000.
        assert over is not None and over > local_engine.max_model_len

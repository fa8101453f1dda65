"""Every request fits the context on the real engine, whatever counted its prompt.

- a job `tokenizer:` counts text, not the chat template: near the limit the engine's own
  /tokenize decides, so a prompt it shortens leaves exactly the context;
- a later turn of `multi_turn: all` carries the answers so far, which no plan-time count
  includes: before it is sent it is reckoned from the engine's usage of the turn before;
  one that cannot fit ends its chain with the turns that did (before: the engine refused it
  and the whole sample, first turn included, was a failure).

- a later turn that fits only with a shorter answer is sent with the room reckoned for it.
  The tiny model's own answers, sent back as text, re-tokenise to 1.5-2.5x their count, so
  here every answer is held to one token ("7", a token a digit: it re-tokenises exactly)
  and the room is known. vLLM 0.32 clamps an answer that would pass the context by itself,
  where SGLang refuses it: SGLang's words are tested with the server's usage scripted
  (tests/unit/running/test_context_turns.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import orjson
from test_pipeline import draftgen, shard_records

from draftgen.engine import LocalEngine
from draftgen.running.context import CHARS_PER_TOKEN_AT_MOST, TEMPLATE_TOKENS


def write_job(tmp: Path, url: str, rows: list[dict[str, object]], *, max_tokens: int,
              extra: str = "", bias: str = "") -> Path:
    (tmp / "p.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    job = tmp / "job.yaml"
    job.write_text(f"""
model: tiny
servers: [{url}]
sampling: {{temperature: 0, extra_body: {{ignore_eos: true{bias}}}}}
partitions: {{p: {{max_tokens: {max_tokens}, concurrency: 2}}}}
categories: [{{name: q, source: {{path: p.jsonl, id_field: id}}, partition: p}}]
output: out
progress_interval_s: 1
{extra}""")
    return job


def test_a_tokenizers_count_near_the_limit_is_settled_by_the_engine(
    local_engine: LocalEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Digits are a token each: 3,480 of them plus a 600-token answer pass 4,096 only with
    # the chat template the job's tokenizer does not count.
    rows: list[dict[str, object]] = [
        {"id": 1, "messages": [{"role": "user", "content": "7" * 3480}]}]
    job = write_job(tmp_path, local_engine.url, rows, max_tokens=610,
                    extra=f"tokenizer: {tiny_model_dir}\n")
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "1/1 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    out = tmp_path / "out"
    [planned] = [orjson.loads(x) for x in (out / "plan.jsonl").read_bytes().splitlines()]
    [record] = shard_records(out)
    served_prompt = record["turns"][0]["prompt_tokens"]
    assert served_prompt > 3480 + 4  # the template's tokens: more than the tokenizer counted
    assert planned["max_tokens"] < 610
    assert served_prompt + planned["max_tokens"] == local_engine.max_model_len
    assert record["turns"][0]["completion_tokens"] == planned["max_tokens"]


def test_a_later_turn_that_cannot_fit_ends_the_chain_with_what_did(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    conversation = [
        {"role": "user", "content": "Count to ten."},
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": "7" * 2600},  # with the first answer: over 4,096
        {"role": "assistant", "content": "done"},
    ]
    job = write_job(tmp_path, local_engine.url, [{"id": 1, "messages": conversation}],
                    max_tokens=1600, extra="multi_turn: all\n")
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "1/1 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    out = tmp_path / "out"
    [planned] = [orjson.loads(x) for x in (out / "plan.jsonl").read_bytes().splitlines()]
    [record] = shard_records(out)
    # The plan fitted the first request to every user turn; the answer it allowed then
    # leaves no room for the second turn, which ends the chain, kept.
    assert len(record["turns"]) == 1
    assert record["turns"][0]["completion_tokens"] == planned["max_tokens"]



def test_a_later_turn_is_shortened_to_the_room_its_answers_leave(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    words = " ".join(["way"] * 1800)  # ~1,800 tokens, counted as 2,400 (characters / 3)
    conversation = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": words},
        {"role": "assistant", "content": "done"},
    ]
    job = write_job(tmp_path, local_engine.url, [{"id": 1, "messages": conversation}],
                    max_tokens=1500, extra="multi_turn: all\nover_context: shorten\n",
                    bias=', logit_bias: {"25": 100}')  # every answer token is "7"
    ran = draftgen("run", str(job))
    assert ran.returncode == 0 and "1/1 done, 0 failed" in ran.stdout, ran.stdout + ran.stderr
    [record] = shard_records(tmp_path / "out")
    first, second = record["turns"]
    assert first["completion_tokens"] == 1500  # the plan left the first turn whole
    assert set(first["content"]) == {"7"}
    # The first answer came back as 1,500 tokens of prompt, and the user turn's ~1,800.
    assert second["prompt_tokens"] >= first["prompt_tokens"] + 1500 + 1800
    room = local_engine.max_model_len - (
        first["prompt_tokens"] + first["completion_tokens"] + TEMPLATE_TOKENS
        + math.ceil(len(words) / CHARS_PER_TOKEN_AT_MOST))
    assert 0 < room < 1500
    # Sent with the room reckoned for it (not 1,500: that would pass the context), and
    # answered to the end of it, inside the context.
    assert second["completion_tokens"] == room
    assert second["finish_reason"] == "length"
    assert second["prompt_tokens"] + second["completion_tokens"] <= local_engine.max_model_len

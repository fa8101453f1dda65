"""The dataset card, on a synthetic run directory written by the real store and writer."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from draftgen import __version__
from draftgen.reporting.card import CARD_NAME, collect, percentile, write_card
from draftgen.sample import Failure, Message, Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter

LOOP = "the same words again and again " * 40
LONG_PROMPT = "You are a careful assistant. " * 100  # over the card's display limit
NOW = 1_800_000_000.0  # 2027-01-15 08:00 UTC

MANIFEST: dict[str, Any] = {
    "draftgen_version": "0.0.9",
    "job_file": "/jobs/mix.yaml",
    "job": {
        "model": "kimi-k2.5",
        "tokenizer": "tok/",
        "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": None, "seed": 7,
                     "extra_body": {"chat_template_kwargs": {"thinking": True}}},
        "partitions": {"short": {"max_tokens": 4096, "concurrency": 64,
                                 "min_prompt_tokens": 0}},
        "samples_per_prompt": 1, "multi_turn": "last", "seed": 3,
    },
    "plan": {"samples": 8, "rejected": 0, "token_count": "tokenizer"},
    "runs": [{"started_at": NOW - 3600, "duration_s": 3500.0,
              "servers": ["http://gpu-a:30000", "http://gpu-b:30000"], "sent": 7, "done": 6,
              "failed": 1, "stopped": None,
              "server_info": {"engine": "sglang", "kv_cache_dtype": "bfloat16"}}],
}


def sample(cat: str, i: int) -> Sample:
    return Sample(id=f"{cat}-{i}", category=cat, partition="short",
                  messages=({"role": "user", "content": f"q{i}"},), max_tokens=4096,
                  fingerprint="fp")


def record(cat: str, i: int, *, system: str | None, out_tokens: int, prompt_tokens: int = 100,
           content: str = "A fine answer.", finish: str = "stop",
           server: str = "http://gpu-a:30000") -> Record:
    msgs: list[Message] = [{"role": "user", "content": f"q{i}"}]
    if system is not None:
        msgs.insert(0, {"role": "system", "content": system})
    t = Turn(content, None, finish, prompt_tokens, out_tokens, 0.1, 1.0)
    return Record(f"{cat}-{i}", "fp", cat, "short", tuple(msgs), (), (t,), server, 1, NOW)


def make_run(out: Path) -> None:
    outcomes: list[Record | Failure] = [
        record("chat", 0, system="Be brief.", out_tokens=10),
        record("chat", 1, system="Be brief.", out_tokens=20, server="http://gpu-b:30000"),
        record("chat", 2, system="Be thorough.", out_tokens=30, content=LOOP),
        record("chat", 3, system="Be brief.", out_tokens=4096, prompt_tokens=900,
               finish="length"),
        Failure("chat-4", "fp", "chat", "short", "bad_request", "400", 1, "http://gpu-a", NOW),
        record("code", 0, system=LONG_PROMPT, out_tokens=2000, prompt_tokens=100),
        record("code", 1, system=None, out_tokens=50),
    ]
    samples = [sample("chat", i) for i in range(6)] + [sample("code", i) for i in range(2)]
    with RunStore.open(out) as store:
        store.write_plan(samples, [])
        store.write_manifest(MANIFEST)

    async def go() -> None:
        async with OutcomeWriter(out) as w:
            for o in outcomes:
                await w.put(o)

    asyncio.run(go())


def table_row(card: str, first_cell: str) -> list[str]:
    for line in card.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells[1:]
    raise AssertionError(f"no table row {first_cell!r}")


def section(card: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", card, re.M | re.S)
    assert m, title
    return m.group(1)


@pytest.fixture
def card(tmp_path: Path) -> str:
    make_run(tmp_path)
    path = write_card(tmp_path, now=NOW)
    assert path == tmp_path / CARD_NAME
    return path.read_text()


def test_counts_per_category_and_overall(card: str) -> None:
    counts = section(card, "Samples")
    # total, done, failed, truncated, flagged, pending, output tokens
    assert table_row(counts, "chat") == ["6", "4", "1", "1", "1", "1", "4156"]
    assert table_row(counts, "code") == ["2", "2", "0", "0", "0", "0", "2050"]
    assert table_row(counts, "**all**") == ["8", "6", "1", "1", "1", "1", "6206"]
    assert "1 of 6 done (16.7%)" in counts
    assert "Flagged by the output checks: 1 (16.7%)" in counts


def test_flag_rates_per_code(card: str) -> None:
    flags = section(card, "Output checks")
    assert table_row(flags, "repetition_loop") == ["1", "0", "1", "16.7%"]
    assert table_row(flags, "truncated_in_answer (truncation)") == ["1", "0", "1", "16.7%"]


def test_output_length_distribution(card: str) -> None:
    lengths = section(card, "Output length (tokens per sample)")
    # samples, min, p50, p90, p99, max
    assert table_row(lengths, "chat") == ["4", "10", "20", "4096", "4096", "4096"]
    assert table_row(lengths, "code") == ["2", "50", "50", "2000", "2000", "2000"]


def test_max_length_warning_counts_samples_a_trainer_would_cut(card: str) -> None:
    text = section(card, "Training length")
    # chat-3: 900 + 4096; code-0: 100 + 2000 > 2048.
    assert "**Warning:** 2 of 6 done samples (33.3%) are longer than max_length=2048" in text
    assert "chat 1, code 1" in text


def test_a_larger_max_length_warns_about_fewer(tmp_path: Path) -> None:
    make_run(tmp_path)
    assert sum(c.too_long for c in collect(tmp_path, max_length=4096).categories.values()) == 1
    text = write_card(tmp_path, max_length=8192, now=NOW).read_text()
    assert "All 6 done samples fit in max_length=8192 tokens" in text


def test_recipe_servers_and_versions(card: str) -> None:
    assert f"Written by draftgen {__version__} on 2027-01-15 08:00 UTC" in card
    assert "generated by draftgen 0.0.9" in card
    recipe = section(card, "Model and sampling")
    assert "- model: `kimi-k2.5`" in recipe
    assert '"temperature": 0.6' in recipe and '"thinking": true' in recipe
    assert "top_k" not in recipe  # unset fields were not sent, so not shown
    assert table_row(recipe, "short") == ["4096", "64", "0"]
    servers = section(card, "Servers and runs")
    assert table_row(servers, "1")[2] == "http://gpu-a:30000, http://gpu-b:30000"
    assert table_row(servers, "http://gpu-a:30000") == ["5"]
    assert table_row(servers, "http://gpu-b:30000") == ["1"]
    assert '"kv_cache_dtype": "bfloat16"' in servers


def test_system_prompts_exactly_once_each_with_counts(card: str) -> None:
    prompts = section(card, "System prompts")
    chat = prompts.split("### chat")[1].split("### code")[0]
    assert "- 3 samples, 9 chars" in chat and "\nBe brief.\n" in chat
    assert "- 1 samples, 12 chars" in chat and "\nBe thorough.\n" in chat
    assert chat.count("Be brief.") == 1
    code = prompts.split("### code")[1]
    assert f"{len(LONG_PROMPT)} chars" in code
    assert f"… ({len(LONG_PROMPT) - 1500} more chars)" in code
    assert "- 1 samples: no system message" in code


def test_a_prompt_with_backticks_cannot_break_out_of_its_block(tmp_path: Path) -> None:
    with RunStore.open(tmp_path) as store:
        store.write_plan([sample("c", 0)], [])

    async def go() -> None:
        async with OutcomeWriter(tmp_path) as w:
            await w.put(record("c", 0, system="Use ```python fences.", out_tokens=5))

    asyncio.run(go())
    text = write_card(tmp_path, now=NOW).read_text()
    assert "````\nUse ```python fences.\n````" in text
    # A run without a manifest still gets a card.
    assert "The manifest holds no job." in text


def test_percentile_is_nearest_rank() -> None:
    v = list(range(1, 101))
    assert [percentile(v, q) for q in (50, 90, 99, 100)] == [50, 90, 99, 100]
    assert percentile([7], 99) == 7


def test_the_training_section_says_how_to_train_reasoning(tmp_path: Path, card: str) -> None:
    # No reasoning in the run: no reasoning advice.
    assert "Reasoning:" not in section(card, "Training with SpecForge")
    think = [Turn("one", "r1", "stop", 10, 5, 0.1, 1.0), Turn("two", "r2", "stop", 20, 5, 0.1,
                                                             1.0)]
    plain = Turn("ok", None, "stop", 10, 5, 0.1, 1.0)
    run = tmp_path / "think"
    with RunStore.open(run) as store:
        store.write_plan([sample("c", 0), sample("c", 1)], [])

    async def go() -> None:
        async with OutcomeWriter(run) as w:
            await w.put(Record("c-0", "fp", "c", "short", ({"role": "user", "content": "q"},),
                               ("more",), tuple(think), "http://x", 1, NOW))
            await w.put(Record("c-1", "fp", "c", "short", ({"role": "user", "content": "q"},),
                               (), (plain,), "http://x", 1, NOW))

    asyncio.run(go())
    text = section(write_card(run, now=NOW).read_text(), "Training with SpecForge")
    assert "Reasoning: 1 of 2 done samples carry the model's reasoning" in text
    assert "`--reasoning field`" in text and "`data.chat_template: qwen3-thinking`" in text
    assert "--expect-reasoning --strict-think-markers" in text
    assert "1 of them have reasoning on a turn before the last user message" in text

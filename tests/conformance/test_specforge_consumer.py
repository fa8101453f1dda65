"""Our exports fed to SpecForge's own data preparation, sample by sample.

SpecForge 0.2.0 (installed `--no-deps` under .cache/oracles/specforge by
scripts/install-oracles.sh) reads a training JSONL through `prepare_prompt_tasks`: records
with `input_ids` and `loss_mask` are taken as they are (pre-tokenised), anything else goes
through its chat template and `build_eagle3_dataset`. For every export that claims SpecForge
compatibility, the tokens under SpecForge's loss mask must decode to exactly what the target
generated for that sample — the end-of-turn token it emitted included, nothing else: no
turn from the source prompt, no end token after a truncated answer, no injected system
prompt. Each case is a record of the kind a run writes (the tiny model's ChatML tokenizer,
SpecForge's `qwen` template, which is ChatML).
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from draftgen.engine import build_tiny_model
from draftgen.export import ExportOptions, export_run
from draftgen.sample import Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter

ROOT = Path(__file__).resolve().parents[2]
SPECFORGE = ROOT / ".cache" / "oracles" / "specforge"
END = "<|im_end|>"
SYSTEM = {"role": "system", "content": "Answer briefly."}


def ask(case: str) -> dict[str, str]:
    # Each case's question names it: SpecForge's raw path does not keep the file's order.
    return {"role": "user", "content": f"What is a drafter? (case {case})"}


def turn(content: str, finish: str = "stop") -> Turn:
    return Turn(content, None, finish, 10, 5, 0.1, 1.0)


# id → (messages sent, follow-ups, generated turns)
CASES: dict[str, tuple[list[dict[str, str]], tuple[str, ...], list[Turn]]] = {
    "plain": ([SYSTEM, ask("plain")], (), [turn("A small model that guesses ahead.")]),
    "no_system": ([ask("no_system")], (), [turn("It proposes tokens.")]),
    "source_turns": ([SYSTEM, ask("source_turns"),
                      {"role": "assistant", "content": "An old answer."},
                      {"role": "user", "content": "Say more."}], (),
                     [turn("The target checks its guesses.")]),
    "truncated": ([SYSTEM, ask("truncated")], (), [turn("It was cut", "length")]),
    "multi_all": ([SYSTEM, ask("multi_all")], ("And why?",),
                  [turn("First reply."), turn("Second reply.")]),
}


@pytest.fixture(scope="module")
def prompt_builder() -> Any:
    if not (SPECFORGE / "specforge").is_dir():
        if os.environ.get("CI"):
            pytest.fail("SpecForge is not installed: run scripts/install-oracles.sh")
        pytest.skip("SpecForge not installed: bash scripts/install-oracles.sh .venv .cache/oracles")
    sys.path.insert(0, str(SPECFORGE))
    from specforge.data import prompt_builder

    return prompt_builder


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return build_tiny_model(ROOT / ".cache" / "tiny-model")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sf") / "run"
    samples = [Sample(id=i, category="c", partition="p", messages=tuple(m), max_tokens=64,
                      followups=f, fingerprint="fp") for i, (m, f, _) in CASES.items()]
    records = [Record(i, "fp", "c", "p", tuple(m), f, tuple(t), "http://x", 1, 1.0)
               for i, (m, f, t) in CASES.items()]

    async def write() -> None:
        async with OutcomeWriter(out) as w:
            for r in records:
                await w.put(r)

    with RunStore.open(out) as store:
        store.write_plan(samples, [])
        store.write_manifest({"job": {"partitions": {"p": {"truncation": "keep"}}}})
    asyncio.run(write())
    return out


def masked_texts(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    runs: list[list[int]] = []
    prev = 0
    for i, m in zip(ids, mask, strict=True):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(i)
        prev = m
    return [str(tok.decode(r, skip_special_tokens=False)) for r in runs]


def expected(case: str) -> list[str]:
    return [t.content + (END if t.finish_reason == "stop" else "") for t in CASES[case][2]]


def through_specforge(prompt_builder: Any, tokenizer_dir: Path, path: Path
                      ) -> Iterator[tuple[str, list[str], str]]:
    """(case, masked texts, whole decoded text) of each row SpecForge prepares from `path`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SpecForge warns about every system message
        tasks = prompt_builder.prepare_prompt_tasks(
            path, tok, chat_template="qwen", max_length=4096, is_preformatted=False,
            train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None)
    rows = path.read_bytes().splitlines()
    assert len(tasks) == len(rows), "SpecForge dropped rows"
    for task in tasks:
        ids = list(task["payload"]["input_ids"])
        mask = list(task["payload"]["loss_mask"])
        text = str(tok.decode(ids))
        (case,) = [c for c in CASES if f"(case {c})" in text]
        yield case, masked_texts(tok, ids, mask), text


def test_the_pre_tokenised_export_is_trained_exactly(
    prompt_builder: Any, tokenizer_dir: Path, run_dir: Path, tmp_path: Path
) -> None:
    to = tmp_path / "tokens.jsonl"
    export_run(run_dir, to, ExportOptions("tokens", tokenizer=str(tokenizer_dir),
                                          include_truncated=True))
    seen = set()
    for case, masked, text in through_specforge(prompt_builder, tokenizer_dir, to):
        seen.add(case)
        assert masked == expected(case), case
        assert ("Answer briefly." in text) is (CASES[case][0][0] == SYSTEM), case
        assert "You are a helpful assistant." not in text, case
    assert seen == set(CASES)


# What SpecForge's conversation path trains on for our conversation export today, pinned
# as observed: each differs from what the target generated, which is why the pre-tokenised
# export is the exact path (issue 20 is open on making the conversation path exact or
# saying so loudly). A change in SpecForge or in the export shows up here.
NEWLINE = "\n"  # the template's, after <|im_end|>: masked in, never generated
SPECFORGE_TRAINS = {
    "plain": ["A small model that guesses ahead." + END + NEWLINE],
    "no_system": ["It proposes tokens." + END + NEWLINE],
    # The source's earlier assistant turn is masked in.
    "source_turns": ["An old answer." + END + NEWLINE,
                     "The target checks its guesses." + END + NEWLINE],
    # An end-of-turn token the model never emitted is appended to the cut answer.
    "truncated": ["It was cut" + END + NEWLINE],
    "multi_all": ["First reply." + END + NEWLINE, "Second reply." + END + NEWLINE],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_specforges_conversation_path_trains_on(
    prompt_builder: Any, tokenizer_dir: Path, run_dir: Path, tmp_path: Path, case: str
) -> None:
    to = tmp_path / "specforge.jsonl"
    export_run(run_dir, to, ExportOptions("specforge", include_truncated=True))
    rows = {c: (m, t) for c, m, t in through_specforge(prompt_builder, tokenizer_dir, to)}
    masked, text = rows[case]
    assert masked == SPECFORGE_TRAINS[case]
    assert masked != expected(case)
    # A row without a system prompt gets the template's, which the target never saw.
    injected = "You are a helpful assistant." in text
    assert injected is (CASES[case][0][0] != SYSTEM), case


def test_the_conversation_export_says_what_specforge_would_train_on(
    run_dir: Path, tmp_path: Path
) -> None:
    summary = export_run(run_dir, tmp_path / "sf.jsonl",
                         ExportOptions("specforge", include_truncated=True))
    notes = "\n".join(summary.notes)
    assert "1 row(s) carry assistant turns from the source prompt" in notes
    assert "1 row(s) are truncated" in notes and "1 row(s) have no system prompt" in notes
    assert "--format tokens" in notes and "note: " in summary.line()
    exact = export_run(run_dir, tmp_path / "t.jsonl",
                       ExportOptions("tokens", tokenizer=str(build_tiny_model(
                           ROOT / ".cache" / "tiny-model")), include_truncated=True))
    assert not any("SpecForge" in n for n in exact.notes)


def test_the_dataset_card_says_which_path_is_exact(run_dir: Path) -> None:
    from draftgen.reporting.card import write_card

    card = write_card(run_dir).read_text()
    section = card.split("## Training with SpecForge", 1)[1].split("\n## ", 1)[0]
    assert "--format tokens`" in section and "`data.prompts_path`" in section
    assert "1 with source assistant turns; 1 with no system prompt; 1 with truncated" in section
    assert "Token ids: 0 of 5 done samples carry the server's own ids" in section

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
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.export import ExportOptions, export_run
from draftgen.local import build_tiny_model
from draftgen.sample import Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter
from helpers.masks import masked_runs

ROOT = Path(__file__).resolve().parents[2]
SPECFORGE = ROOT / ".cache" / "oracles" / "specforge"
END = "<|im_end|>"
SYSTEM = {"role": "system", "content": "Answer briefly."}


def ask(case: str) -> dict[str, str]:
    # Each case's question names it: SpecForge's raw path does not keep the file's order.
    return {"role": "user", "content": f"What is a drafter? (case {case})"}


def turn(content: str, finish: str = "stop", reasoning: str | None = None) -> Turn:
    return Turn(content, reasoning, finish, 10, 5, 0.1, 1.0)


Cases = dict[str, tuple[list[dict[str, str]], tuple[str, ...], list[Turn]]]


# id → (messages sent, follow-ups, generated turns)
CASES: Cases = {
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


def write_run(out: Path, cases: Cases, job: dict[str, Any]) -> Path:
    """A run directory holding one done record per case, as a run writes it."""
    samples = [Sample(id=i, category="c", partition="p", messages=tuple(m), max_tokens=64,
                      followups=f, fingerprint="fp") for i, (m, f, _) in cases.items()]
    records = [Record(i, "fp", "c", "p", tuple(m), f, tuple(t), "http://x", 1, 1.0)
               for i, (m, f, t) in cases.items()]

    async def write() -> None:
        async with OutcomeWriter(out) as w:
            for r in records:
                await w.put(r)

    with RunStore.open(out) as store:
        store.write_plan(samples, [])
        store.write_manifest({"job": {"partitions": {"p": {"truncation": "keep"}}, **job}})
    asyncio.run(write())
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("sf") / "run", CASES, {})


def masked_texts(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    return [str(tok.decode(r, skip_special_tokens=False)) for r in masked_runs(ids, mask)]


def expected(case: str) -> list[str]:
    return [t.content + (END if t.finish_reason == "stop" else "") for t in CASES[case][2]]


def through_specforge(prompt_builder: Any, tokenizer_dir: Path, path: Path,
                      template: str = "qwen", cases: Iterable[str] = CASES
                      ) -> Iterator[tuple[str, list[str], str]]:
    """(case, masked texts, whole decoded text) of each row SpecForge prepares from `path`
    with its chat template `template`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SpecForge warns about every system message
        tasks = prompt_builder.prepare_prompt_tasks(
            path, tok, chat_template=template, max_length=4096, is_preformatted=False,
            train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None)
    rows = path.read_bytes().splitlines()
    assert len(tasks) == len(rows), "SpecForge dropped rows"
    for task in tasks:
        ids = list(task["payload"]["input_ids"])
        mask = list(task["payload"]["loss_mask"])
        text = str(tok.decode(ids))
        (case,) = [c for c in cases if f"(case {c})" in text]
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


# Reasoning. The model's template here is Qwen3's thinking logic (written for these tests on
# the tiny tokenizer): an assistant turn after the last user message is `<think>\nR\n</think>
# \n\nA`, newlines around R and before A stripped, `reasoning_content` read or split out of
# `content`; earlier turns lose their reasoning. SpecForge's `qwen3-thinking` template
# (parser_type "thinking") keeps `reasoning_content` and renders with enable_thinking=True.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if m.reasoning_content is string %}{%- set reasoning = m.reasoning_content %}"
    "{%- elif '</think>' in content %}{%- set reasoning = content.split('</think>')[0]"
    ".rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
THINK: Cases = {
    "think": ([SYSTEM, ask("think")], (),
              [turn("A small model that guesses ahead.", reasoning="They ask what it is.")]),
    "think_newlines": ([SYSTEM, ask("think_newlines")], (),
                       [turn("\n\nIt proposes tokens.", reasoning="\nShort answer.\n")]),
    "think_multi": ([SYSTEM, ask("think_multi")], ("And why?",),
                    [turn("First reply.", reasoning="First thought."),
                     turn("Second reply.", reasoning="Second thought.")]),
}


@pytest.fixture(scope="module")
def qwen3_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("qwen3") / "tok"
    shutil.copytree(tokenizer_dir, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": QWEN3}))
    return dest


@pytest.fixture(scope="module")
def think_run(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The job names the model's tokenizer: the export derives its reasoning style from it.
    return write_run(tmp_path_factory.mktemp("think") / "run", THINK,
                     {"tokenizer": str(qwen3_dir)})


def rendered(tokenizer_dir: Path, case: str, *, reasoning: bool = True) -> list[str]:
    """Each generated turn of `case` as the model's template renders the conversation (the
    target's reasoning and answer, not what our export wrote), end-of-turn token included."""
    from transformers import AutoTokenizer

    msgs, followups, turns = THINK[case]
    conv: list[dict[str, Any]] = list(msgs)
    for i, t in enumerate(turns):
        conv += [{"role": "user", "content": followups[i - 1]}] if i else []
        conv.append({"role": "assistant", "content": t.content,
                     **({"reasoning_content": t.reasoning} if reasoning else {})})
    text = AutoTokenizer.from_pretrained(str(tokenizer_dir)).apply_chat_template(
        conv, tokenize=False)
    return [part.split(END)[0] + END for part in text.split("<|im_start|>assistant\n")[1:]]


def test_the_rendering_the_reasoning_tests_expect(qwen3_dir: Path) -> None:
    # What `rendered` gives, spelled out once: the Qwen3 wrapper, newlines stripped, the
    # earlier turn of a multi-turn row without its reasoning.
    think = "<think>\n{}\n</think>\n\n{}" + END
    assert rendered(qwen3_dir, "think") == [
        think.format("They ask what it is.", "A small model that guesses ahead.")]
    assert rendered(qwen3_dir, "think_newlines") == [
        think.format("Short answer.", "It proposes tokens.")]
    assert rendered(qwen3_dir, "think_multi") == [
        "First reply." + END, think.format("Second thought.", "Second reply.")]
    assert rendered(qwen3_dir, "think", reasoning=False) == [
        think.format("", "A small model that guesses ahead.")]


@pytest.mark.parametrize(("mode", "template", "trained"), [
    ("field", "qwen3-thinking", True), ("inline", "qwen3-thinking", True),
    ("inline", "qwen", True),
    # SpecForge's non-thinking templates drop reasoning_content: the model's template then
    # renders an empty think block the target never generated.
    ("field", "qwen", False),
])
def test_reasoning_through_specforges_conversation_path(
    prompt_builder: Any, qwen3_dir: Path, think_run: Path, tmp_path: Path, mode: str,
    template: str, trained: bool
) -> None:
    to = tmp_path / "specforge.jsonl"
    export_run(think_run, to, ExportOptions("specforge", reasoning=mode))  # type: ignore[arg-type]
    seen = set()
    for case, masked, _ in through_specforge(prompt_builder, qwen3_dir, to, template, THINK):
        seen.add(case)
        assert masked == [r + NEWLINE for r in rendered(qwen3_dir, case, reasoning=trained)]
    assert seen == set(THINK)


def test_the_pre_tokenised_export_trains_reasoning_exactly(
    prompt_builder: Any, qwen3_dir: Path, think_run: Path, tmp_path: Path
) -> None:
    ids = {}
    for mode in ("inline", "field"):
        to = tmp_path / f"{mode}.jsonl"
        export_run(think_run, to, ExportOptions("tokens", reasoning=mode))  # type: ignore[arg-type]
        for case, masked, _ in through_specforge(prompt_builder, qwen3_dir, to, "qwen", THINK):
            assert masked == rendered(qwen3_dir, case), (mode, case)
        ids[mode] = [orjson.loads(r)["input_ids"] for r in to.read_bytes().splitlines()]
    assert ids["inline"] == ids["field"]


def validator_rejects(row: dict[str, Any], *, expect_reasoning: bool = False,
                      strict_think_markers: bool = False) -> str | None:
    """Why SpecForge's scripts/validate_regenerated_data.py would reject `row` (None: it
    passes), re-derived from that script and scripts/conversation_validation.py (not in the
    wheel; read in sgl-project/SpecForge's forks Boreas618/SpecForge @6ccb4c01 and
    yudigege86/SpecForge): a non-empty string id, status "success", string contents (non-empty
    but for the assistant's), system messages only before the first user, user/assistant
    alternating from a user and ending on an assistant; --expect-reasoning: a non-empty
    reasoning_content on every assistant message; --strict-think-markers: no <think> or
    </think> (any case) in an assistant's content or reasoning_content."""
    msgs = row.get("conversations") or []
    if not (isinstance(row.get("id"), str) and row["id"].strip()):
        return "id"
    if row.get("status") != "success":
        return "status"
    want, seen_user = "user", False
    for m in msgs:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str) or (role != "assistant" and not content.strip()):
            return "content"
        if role == "system" and not seen_user:
            continue
        if role != want:
            return "role order"
        seen_user, want = True, "assistant" if role == "user" else "user"
    if not seen_user or not msgs or msgs[-1]["role"] != "assistant":
        return "no user, or not ending on an assistant"
    for m in (m for m in msgs if m["role"] == "assistant"):
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return "reasoning_content type"
        if expect_reasoning and not (reasoning or "").strip():
            return "no reasoning_content"
        texts = (m["content"].lower(), (reasoning or "").lower())
        if strict_think_markers and any("<think>" in t or "</think>" in t for t in texts):
            return "thinking marker"
    return None


def test_reasoning_rows_and_specforges_validator(think_run: Path, tmp_path: Path) -> None:
    rows = {}
    for mode in ("inline", "field"):
        to = tmp_path / f"{mode}.jsonl"
        export_run(think_run, to, ExportOptions("specforge", reasoning=mode))  # type: ignore[arg-type]
        rows[mode] = [orjson.loads(r) for r in to.read_bytes().splitlines()]
    strict = {"expect_reasoning": True, "strict_think_markers": True}
    assert [validator_rejects(r, **strict) for r in rows["field"]] == [None] * len(THINK)
    # Inline reasoning is in `content`, with markers: valid rows, but not for the reasoning
    # checks, which want reasoning_content (the export's notes say to use field for them).
    assert [validator_rejects(r) for r in rows["inline"]] == [None] * len(THINK)
    assert {validator_rejects(r, strict_think_markers=True) for r in rows["inline"]} == {
        "thinking marker"}
    # The validator's own failure modes, so the checks above can fail.
    field = rows["field"][0]
    last = field["conversations"][-1]
    assert validator_rejects({**field, "status": "ok"}) == "status"
    assert validator_rejects({**field, "conversations": [*field["conversations"][:-1], {
        **last, "reasoning_content": ""}]}, **strict) == "no reasoning_content"


def test_the_export_writes_reasoning_as_the_models_template_does(
    think_run: Path, qwen3_dir: Path, tmp_path: Path
) -> None:
    inline = export_run(think_run, tmp_path / "i.jsonl", ExportOptions("specforge"))
    (think,) = [orjson.loads(r) for r in (tmp_path / "i.jsonl").read_bytes().splitlines()
                if b"case think_newlines" in r]
    # Exactly the template's text: wrapper, newlines stripped as it strips them.
    assert think["conversations"][-1]["content"] + END == rendered(qwen3_dir,
                                                                   "think_newlines")[0]
    notes = "\n".join(inline.notes)
    assert f"3 row(s) carry reasoning inline as the chat template of {qwen3_dir}" in notes
    assert "--strict-think-markers rejects" in notes
    assert "1 row(s) have reasoning on a turn before the last user message" in notes
    field = export_run(think_run, tmp_path / "f.jsonl",
                       ExportOptions("specforge", reasoning="field"))
    assert "3 row(s) carry reasoning_content, which SpecForge keeps only under a thinking " \
           "chat template (data.chat_template qwen3-thinking" in "\n".join(field.notes)


def test_without_a_template_reasoning_is_written_in_the_common_convention(
    prompt_builder: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    run = write_run(tmp_path / "run", THINK, {})
    summary = export_run(run, tmp_path / "sf.jsonl", ExportOptions("specforge"))
    assert "not derived from the model's chat template (no tokenizer" in "\n".join(
        summary.notes)
    wrap = "<think>\n{}\n</think>\n\n{}"
    for case, masked, _ in through_specforge(prompt_builder, tokenizer_dir,
                                             tmp_path / "sf.jsonl", "qwen", THINK):
        # The tiny model's ChatML template writes content as it is.
        assert masked == [wrap.format(t.reasoning, t.content) + END + NEWLINE
                          for t in THINK[case][2]], case
    # A template that renders no reasoning: the same convention, said so.
    summary = export_run(run, tmp_path / "t.jsonl",
                         ExportOptions("specforge", tokenizer=str(tokenizer_dir)))
    assert f"the chat template of {tokenizer_dir} renders no reasoning" in "\n".join(
        summary.notes)


def test_the_reasoning_style_is_read_off_any_template() -> None:
    from draftgen.export.base import ExportContext, Thinking, derive_style

    def opens_think(msgs: Any, generation: bool) -> str:
        # Qwen3.5-style: the generation prompt opens the think block, so the model's own
        # output (and SpecForge's qwen3.5 header) starts after it.
        turns = [f"<{m['role']}>{m['content']}" if m["role"] != "assistant" else
                 f"<a><think>\n{m.get('reasoning_content', '')}\n</think>\n\n{m['content']}"
                 for m in msgs]
        return "".join(turns) + ("<a><think>\n" if generation else "")

    style = derive_style(opens_think, "t", "field")
    assert (style.open, style.close, style.drops_earlier) == ("", "\n</think>\n\n", False)
    assert style.inline("R", "A") == "R\n</think>\n\nA"

    def refuses(msgs: Any, generation: bool) -> str:
        raise ValueError("no")

    th = Thinking(ExportContext(Path(), {}), ExportOptions(), render=refuses, source="t")
    rec = {"messages": [ask("x")], "turns": [{"content": "A", "reasoning": "R"}]}
    assert th.conversation(rec)[-1]["content"] == "<think>\nR\n</think>\n\nA"
    assert "its template cannot render a probe (no)" in th.notes()[0]


def test_the_dataset_card_says_how_to_train_reasoning(think_run: Path) -> None:
    from draftgen.reporting.card import write_card

    card = write_card(think_run).read_text()
    section = card.split("## Training with SpecForge", 1)[1].split("\n## ", 1)[0]
    assert "Reasoning: 3 of 3 done samples" in section
    assert "`--reasoning field`" in section and "`data.chat_template: qwen3-thinking`" in section
    assert "--expect-reasoning --strict-think-markers" in section

"""Output checks on crafted outputs, and what their flags do in the ledger, status and export."""

from __future__ import annotations

import asyncio
import glob
import inspect
import json.decoder
import random
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from draftgen.export import ExportOptions, export_run
from draftgen.quality.checks import (
    check_turns,
    is_repetition_loop,
    quality_flags,
    repetition_share,
)
from draftgen.reporting.status import read_status
from draftgen.sample import Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.ledger import load_ledger
from draftgen.store.run_store import LEDGER
from draftgen.store.writer import OutcomeWriter

PROSE = (
    "Rivers shape the land they cross. Over thousands of years a river carves its valley, "
    "carries sediment from the mountains and lays it down where the current slows, building "
    "plains and deltas that farmers have worked since the first cities rose. The Nile's yearly "
    "flood, for instance, renewed the soil of Egypt until the Aswan dam held it back.\n\n"
    "Not every river reaches the sea. Some end in inland basins and evaporate, leaving salt "
    "flats behind; others vanish into sand. Their flow depends on rain, snowmelt and "
    "groundwater, and a dry decade can shrink a great river to a chain of ponds. Engineers "
    "measure discharge in cubic metres per second, and hydrologists model how a catchment "
    "responds to a storm: how quickly the water arrives, how high the peak climbs, and how "
    "long the recession lasts before the channel returns to its base flow.\n\n"
    "Rivers also move people. Trade followed the Rhine, the Yangtze and the Mississippi long "
    "before railways, and many capitals stand where a river could be bridged or forded. "
    "Today their water cools power stations, irrigates fields and fills reservoirs, while "
    "conservationists work to restore the floodplains and fish ladders that dams removed.\n"
)
PARAGRAPH = ("The mitochondria is the powerhouse of the cell, producing ATP through oxidative "
             "phosphorylation. This relies on a gradient of protons across the inner "
             "membrane, which drives ATP synthase. ")


def turn(content: str, reasoning: str | None = None, finish: str = "stop") -> dict[str, Any]:
    return {"content": content, "reasoning": reasoning, "finish_reason": finish}


# --- flags per turn --------------------------------------------------------------------

@pytest.mark.parametrize(("t", "flags"), [
    (turn("Paris is the capital of France."), ()),
    (turn("I'm sorry, but I can't help with that request."), ()),  # refusals are data
    (turn(""), ("empty_answer",)),
    (turn("  \n\t "), ("empty_answer",)),
    (turn("", reasoning="The user asks for 2+2. That is 4."), ("reasoning_without_answer",)),
    # Cut by max_tokens while still reasoning: the truncation code says it all.
    (turn("", reasoning="Let me think about", finish="length"), ("truncated_in_reasoning",)),
    (turn("The answer is", reasoning="2+2=4", finish="length"), ("truncated_in_answer",)),
    (turn("The answer is", finish="length"), ("truncated_in_answer",)),
    (turn("", finish="length"), ("empty_answer", "truncated_in_answer")),
    (turn("<think>2+2 is 4</think>The answer is 4."), ("leaked_reasoning",)),
    (turn("The answer is 4.</think>"), ("leaked_reasoning",)),
    (turn("◁think▷hmm◁/think▷Four."), ("leaked_reasoning",)),
    (turn("<|thinking|>hmm"), ("leaked_reasoning",)),
    # Markers in the reasoning field are where they belong.
    (turn("Four.", reasoning="<think>hmm</think>"), ()),
])
def test_each_check_on_a_crafted_turn(t: dict[str, Any], flags: tuple[str, ...]) -> None:
    assert check_turns([t]) == flags


def test_turn_records_and_their_stored_json_get_the_same_flags() -> None:
    looping = "the same words again " * 60
    as_turn = Turn(looping, "short thought", "length", 5, 300, 0.1, 1.0)
    as_json = orjson.loads(orjson.dumps(as_turn))
    assert check_turns([as_turn]) == check_turns([as_json]) == (
        "repetition_loop", "truncated_in_answer")


def test_flags_of_several_turns_are_united_in_a_stable_order() -> None:
    turns = [turn("<think>x</think>ok"), turn("", finish="length"), turn("fine")]
    assert check_turns(turns) == ("empty_answer", "leaked_reasoning", "truncated_in_answer")


def test_reasoning_markers_can_be_chosen() -> None:
    t = [turn("[[reasoning]] hidden [[/reasoning]] Four.")]
    assert check_turns(t) == ()
    assert check_turns(t, reasoning_markers=("[[reasoning]]",)) == ("leaked_reasoning",)


def test_quality_flags_leave_truncation_to_its_own_rule() -> None:
    assert quality_flags(("truncated_in_answer",)) == []
    assert quality_flags(("repetition_loop", "truncated_in_reasoning")) == ["repetition_loop"]
    assert quality_flags(None) == []


# --- repetition loops ------------------------------------------------------------------

def _numbered_steps() -> str:
    return "".join(f"Step {i}: Let me recompute the value of x by substituting it back into "
                   "the equation.\n" for i in range(40))


def _loop_with_edits() -> str:
    rng = random.Random(0)
    return "".join(PARAGRAPH.replace("cell", rng.choice(["cell", "body", "unit", "organism"]))
                   .replace("drives", rng.choice(["drives", "powers", "runs"]))
                   for _ in range(8))


LOOPS = {
    "one word": "the " * 300,
    "one sentence after prose": PROSE + "I cannot answer that. " * 60,
    "a paragraph after prose": PROSE + PARAGRAPH * 8,
    "a long paragraph": PROSE[:300] + PROSE[300:1500] * 5,
    "numbered steps": PROSE + _numbered_steps(),
    "copies with small edits": PROSE + _loop_with_edits(),
    "one character": "Sure" + "!" * 1000,
    "digits": "pi = 3.14159" + "9" * 800,
    "newlines": "Answer:" + "\n" * 600,
    "reasoning-style": "Wait, let me double-check: 2+2=4. Yes, that is right. " * 40,
    "loop, then a short ending": PROSE + PARAGRAPH * 6 + "In short, ATP synthase makes ATP.",
    "chinese": "这是一个很长的句子，我们在这里重复它。" * 80,
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_loops_are_flagged(name: str) -> None:
    assert is_repetition_loop(LOOPS[name]), repetition_share(LOOPS[name])
    assert check_turns([turn(LOOPS[name])]) == ("repetition_loop",)


def test_a_loop_in_the_reasoning_alone_is_flagged() -> None:
    t = turn("The answer is 4.", reasoning="Hmm, wait. Let me re-check the sum. " * 50)
    assert check_turns([t]) == ("repetition_loop",)


def _markdown_table() -> str:
    rng = random.Random(1)
    rows = "".join(f"| {city} | {rng.randint(1, 40)} | {rng.randint(300, 2000)} mm |\n"
                   for city in ["Oslo", "Lima", "Perth", "Kyoto", "Quito", "Accra", "Hanoi",
                                "Porto", "Dakar", "Cusco", "Turin", "Tunis", "Leeds", "Sofia",
                                "Minsk", "Dubai", "Cairo", "Delhi", "Seoul", "Busan"] * 2)
    return "| city | days of rain | rainfall |\n|---|---:|---:|\n" + rows


def _json_array() -> str:
    rng = random.Random(2)
    items = [{"id": i, "name": f"item-{rng.randint(100, 999)}", "price": rng.randint(1, 99),
              "tags": [rng.choice(["a", "b", "c"])]} for i in range(40)]
    return orjson.dumps(items, option=orjson.OPT_INDENT_2).decode()


def _recipe_list() -> str:
    steps = ["Preheat the oven to 180 degrees.", "Butter a round cake tin.",
             "Cream the butter and sugar until pale.", "Beat in the eggs one at a time.",
             "Fold in the flour with a metal spoon.", "Add the milk to loosen the batter.",
             "Spoon the batter into the tin and level it.", "Bake for 25 minutes.",
             "Test with a skewer; it should come out clean.", "Cool in the tin for ten "
             "minutes.", "Turn out onto a wire rack.", "Whip the cream with vanilla.",
             "Spread jam over the bottom layer.", "Add the cream and the top layer.",
             "Dust with icing sugar and serve the same day."]
    return "Here is the recipe:\n\n" + "".join(f"{i}. {s}\n" for i, s in enumerate(steps, 1))


def _bullet_list() -> str:
    return "Key points:\n" + "".join(
        f"- **{k}**: {v}\n" for k, v in [
            ("Latency", "the time one request takes from send to last token"),
            ("Throughput", "tokens generated per second across all requests"),
            ("Concurrency", "how many requests are in flight at once"),
            ("KV cache", "memory holding attention keys and values per token"),
            ("Preemption", "a running request evicted to free cache blocks"),
            ("Prefix cache", "shared prompt prefixes computed once and reused"),
            ("Batch size", "requests the engine steps forward together"),
            ("Prefill", "processing the prompt before the first output token"),
            ("Decode", "generating one token per step per request"),
            ("Speculation", "a small drafter proposes tokens the target verifies")])


def _code_quoted_twice() -> str:
    src = inspect.getsource(textwrap.TextWrapper._wrap_chunks)
    return ("Your function:\n```python\n" + src + "```\nFixed version:\n```python\n"
            + src.replace("chunks.reverse()", "chunks = chunks[::-1]") + "```\n")


NOT_LOOPS = {
    "prose": PROSE,
    "python module": inspect.getsource(json.decoder),
    "python class": inspect.getsource(textwrap),
    "markdown table": _markdown_table(),
    "json array": _json_array(),
    "numbered recipe": _recipe_list(),
    "bullet list": _bullet_list(),
    "code quoted twice with a fix": _code_quoted_twice(),
    "too short to judge": "ha " * 100,
}


@pytest.mark.parametrize("name", list(NOT_LOOPS))
def test_ordinary_outputs_are_not_loops(name: str) -> None:
    text = NOT_LOOPS[name]
    assert not is_repetition_loop(text), repetition_share(text)
    assert check_turns([turn(text)]) == ()


def test_the_standard_library_is_almost_never_a_loop() -> None:
    # Real code at scale: every 2000-character prefix's tail of every non-test module.
    lib = sysconfig.get_paths()["stdlib"]
    windows = flagged = 0
    for path in glob.glob(f"{lib}/**/*.py", recursive=True):
        if "site-packages" in path or "test" in path:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for end in range(len(text), 0, -2000):
            windows += 1
            flagged += is_repetition_loop(text[:end])
    assert windows > 2000
    assert flagged / windows < 0.003, (flagged, windows)


# --- flags in the ledger, status and exports --------------------------------------------

GOOD = "Rivers carve valleys and build deltas. " * 2
LOOPING = PROSE + PARAGRAPH * 8


def sample(i: int, cat: str = "c") -> Sample:
    return Sample(id=f"{cat}-{i}", category=cat, partition="short",
                  messages=({"role": "user", "content": f"q{i}"},), max_tokens=8,
                  fingerprint="fp")


def record(i: int, content: str, *, cat: str = "c", finish: str = "stop",
           reasoning: str | None = None) -> Record:
    t = Turn(content, reasoning, finish, 3, 5, 0.01, 0.1)
    msgs = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"})
    return Record(f"{cat}-{i}", "fp", cat, "short", msgs, (), (t,), "http://x", 1, 1.0)


def make_run(out: Path, records: list[Record], manifest: dict[str, Any] | None = None) -> None:
    async def go() -> None:
        async with OutcomeWriter(out) as w:
            for r in records:
                await w.put(r)

    with RunStore.open(out) as store:
        store.write_plan([sample(int(r.id.split("-")[1]), r.category) for r in records], [])
        if manifest is not None:
            store.write_manifest(manifest)
    asyncio.run(go())


RECORDS = [record(0, GOOD), record(1, LOOPING), record(2, "<think>x</think>Four."),
           record(3, "cut", finish="length"), record(4, LOOPING, finish="length"),
           record(5, "")]


def test_the_writer_records_flags_in_the_ledger(tmp_path: Path) -> None:
    make_run(tmp_path, RECORDS)
    entries = load_ledger(tmp_path / LEDGER, repair=False).entries
    assert {k: e.flags for k, e in entries.items()} == {
        "c-0": None, "c-1": ["repetition_loop"], "c-2": ["leaked_reasoning"],
        "c-3": ["truncated_in_answer"], "c-4": ["repetition_loop", "truncated_in_answer"],
        "c-5": ["empty_answer"]}
    # A clean sample's line has no flags key: ledgers stay as small as before.
    first = orjson.loads((tmp_path / LEDGER).read_bytes().splitlines()[0])
    assert "flags" not in first


def test_a_record_adopted_after_a_crash_gets_its_flags(tmp_path: Path) -> None:
    make_run(tmp_path, RECORDS[:1])
    shard = tmp_path / "shards" / "00001.jsonl"
    with open(shard, "ab") as f:  # killed after the shard fsync, before the ledger line
        f.write(orjson.dumps(record(1, LOOPING)) + b"\n")
    with RunStore.open(tmp_path) as store:
        assert store.repair.adopted_records == 1
        assert store.entries["c-1"].flags == ["repetition_loop"]


def test_an_old_ledger_without_flags_still_loads(tmp_path: Path) -> None:
    make_run(tmp_path, RECORDS)
    ledger = tmp_path / LEDGER
    lines = [orjson.loads(x) for x in ledger.read_bytes().splitlines()]
    ledger.write_bytes(b"".join(orjson.dumps({k: v for k, v in d.items() if k != "flags"})
                                + b"\n" for d in lines))
    entries = load_ledger(ledger, repair=False).entries
    assert len(entries) == 6 and all(e.flags is None for e in entries.values())
    # Export checks the records themselves when the ledger has no flags.
    s = export_run(tmp_path, tmp_path / "sf.jsonl", ExportOptions())
    assert (s.exported, s.flagged, s.truncated, s.empty) == (1, 2, 2, 1)


def test_status_counts_flags_per_code_and_flagged_samples_per_category(tmp_path: Path) -> None:
    make_run(tmp_path, [*RECORDS, record(0, LOOPING, cat="d")])
    st = read_status(tmp_path)
    assert st.flags == {"repetition_loop": 3, "leaked_reasoning": 1, "truncated_in_answer": 2,
                        "empty_answer": 1}
    assert st.categories["c"].flagged == 4 and st.categories["d"].flagged == 1
    assert st.flagged == 5
    as_json = st.as_json()
    assert as_json["flags"]["repetition_loop"] == 3
    assert as_json["categories"]["d"]["flagged"] == 1


def test_export_leaves_flagged_samples_out_unless_asked(tmp_path: Path) -> None:
    make_run(tmp_path, RECORDS)
    to = tmp_path / "sf.jsonl"
    s = export_run(tmp_path, to, ExportOptions())
    # c-3 and c-4 are truncated; c-5 is empty; c-1 (loop) and c-2 (leaked) are flagged.
    assert (s.exported, s.flagged, s.truncated, s.empty) == (1, 2, 2, 1)
    assert "2 flagged" in s.line()
    assert [orjson.loads(x)["id"] for x in to.read_bytes().splitlines()] == ["c-0"]

    s = export_run(tmp_path, to, ExportOptions(include_flagged=True))
    assert (s.exported, s.flagged) == (3, 0)
    # Truncation keeps its own rule: a truncated loop needs both switches.
    s = export_run(tmp_path, to, ExportOptions(include_truncated=True))
    assert (s.exported, s.flagged, s.truncated) == (2, 3, 0)
    s = export_run(tmp_path, to, ExportOptions(include_truncated=True, include_flagged=True))
    assert s.exported == 5 and s.empty == 1


def test_exports_carry_the_requests_chat_template_kwargs(tmp_path: Path) -> None:
    kwargs = {"thinking": True}
    make_run(tmp_path, RECORDS[:1],
             {"job": {"sampling": {"extra_body": {"chat_template_kwargs": kwargs}}}})
    for fmt in ("specforge", "sharegpt"):
        export_run(tmp_path, tmp_path / f"{fmt}.jsonl", ExportOptions(fmt))
        row = orjson.loads((tmp_path / f"{fmt}.jsonl").read_bytes())
        assert row["chat_template_kwargs"] == kwargs
    export_run(tmp_path, tmp_path / "p.parquet", ExportOptions("parquet"))
    col = pq.read_table(tmp_path / "p.parquet").column("chat_template_kwargs").to_pylist()
    assert [orjson.loads(c) for c in col] == [kwargs]


def test_exports_without_template_kwargs_add_nothing(tmp_path: Path) -> None:
    make_run(tmp_path, RECORDS[:1], {"job": {"sampling": {"extra_body": {}}}})
    export_run(tmp_path, tmp_path / "sf.jsonl", ExportOptions())
    assert "chat_template_kwargs" not in orjson.loads((tmp_path / "sf.jsonl").read_bytes())
    export_run(tmp_path, tmp_path / "p.parquet", ExportOptions("parquet"))
    assert pq.read_table(tmp_path / "p.parquet").column(
        "chat_template_kwargs").to_pylist() == [None]


def test_ignored_seeds_are_said_once_per_server() -> None:
    from draftgen.store.reading import seeds_ignored_note

    server = {"url": "http://a:30000", "engine": "sglang", "seeds_honoured": False}
    manifest = {"job": {"sampling": {"seed": 1}}, "runs": [{"servers": [server]},
                                                         {"servers": [server]}]}
    note = seeds_ignored_note(manifest)
    assert note is not None and note.count("http://a:30000") == 1
    assert "--enable-deterministic-inference" in note
    unseeded = {**manifest, "job": {"sampling": {}}}
    honoured = {**manifest, "runs": [{"servers": [{**server, "seeds_honoured": True}]}]}
    assert seeds_ignored_note(unseeded) is None and seeds_ignored_note(honoured) is None

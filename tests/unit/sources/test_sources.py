"""Reading rows from each format and normalising them, with every rejection reason."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftgen.errors import HostError, JobError
from draftgen.job import Source
from draftgen.sample import Rejected
from draftgen.sources import SampleReader, SourcePrompt, open_source, reason_code


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False))
            f.write("\n")
    return path


def read_all(
    tmp_path: Path,
    rows: list[Any],
    multi_turn: Literal["last", "all"] = "last",
    system_prompt: str | None = None,
    **source: Any,
) -> list[SourcePrompt | Rejected]:
    write_jsonl(tmp_path / "p.jsonl", rows)
    reader = open_source(Source(path="p.jsonl", **source), tmp_path)
    return list(reader.read("cat", multi_turn, system_prompt))


def read_one(tmp_path: Path, row: Any, **kw: Any) -> SourcePrompt | Rejected:
    (item,) = read_all(tmp_path, [row], **kw)
    return item


def rejected_code(item: SourcePrompt | Rejected) -> str:
    assert isinstance(item, Rejected), f"expected a rejection, got {item}"
    return reason_code(item.reason)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def asst(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# --- formats -------------------------------------------------------------------------


def test_jsonl_rows_numbered_by_line_skipping_blank_lines_and_bom(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"messages": [user("first")]}),
        "",
        "   ",
        json.dumps({"messages": [user("x")]}),
    ]
    p.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    items = list(open_source(Source(path="p.jsonl"), tmp_path).read("cat"))
    assert [type(i) for i in items] == [SourcePrompt, SourcePrompt]
    assert [i.row for i in items] == [1, 4]
    assert isinstance(items[0], SourcePrompt)
    assert items[0].messages == (user("first"),)


def test_jsonl_reader_streams_without_reading_the_whole_file(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "p.jsonl", [{"messages": [user(f"q{i}")]} for i in range(1000)])
    reader = open_source(Source(path="p.jsonl"), tmp_path)
    first = next(iter(reader.read("cat")))
    assert isinstance(first, SourcePrompt) and first.messages[0]["content"] == "q0"


def test_json_array_file_is_read_as_rows(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))
    items = list(open_source(Source(path="d.json", layout="conversations"), tmp_path).read("c"))
    assert [i.row for i in items] == [0, 1, 2]
    assert all(isinstance(i, SourcePrompt) for i in items)


def test_parquet_rows_numbered_from_zero(tmp_path: Path) -> None:
    table = pa.table(
        {
            "messages": [[user("a")], [user("b"), asst("c"), user("d")], []],
            "uid": ["x1", "x2", "x3"],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    reader = open_source(Source(path="p.parquet", id_field="uid"), tmp_path)
    items = list(reader.read("cat"))
    assert [i.row for i in items] == [0, 1, 2]
    a, b, c = items
    assert isinstance(a, SourcePrompt) and a.id == "x1" and a.messages == (user("a"),)
    assert isinstance(b, SourcePrompt) and b.messages == (user("b"), asst("c"), user("d"))
    assert rejected_code(c) == "empty_prompt"


def test_parquet_read_in_batches_keeps_row_numbers(tmp_path: Path) -> None:
    from draftgen.sources import parquet

    n = parquet.BATCH_ROWS + 10
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(n)]}), tmp_path / "p.parquet")
    items = list(open_source(Source(path="p.parquet", layout="prompt"), tmp_path).read("c"))
    assert len(items) == n
    last = items[-1]
    assert isinstance(last, SourcePrompt) and last.row == n - 1
    assert last.messages == (user(f"p{n - 1}"),)


def test_format_is_chosen_by_extension_or_stated(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "rows.txt", [{"messages": [user("a")]}])
    with pytest.raises(JobError, match=r"set source\.format"):
        open_source(Source(path="rows.txt"), tmp_path)
    reader = open_source(Source(path="rows.txt", format="jsonl"), tmp_path)
    assert len(list(reader.read("c"))) == 1


def test_missing_file_is_a_job_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(JobError, match=r"nope\.jsonl: no such file"):
        open_source(Source(path="nope.jsonl"), tmp_path)


def test_hf_without_datasets_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    # A missing package is the machine's problem, not the job's: the CLI exits 1.
    with pytest.raises(HostError, match=r"pip install 'draftgen\[hf\]'"):
        open_source(Source(hf_dataset="org/prompts"), tmp_path)


def test_hf_reader_loads_named_split_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `datasets` is an optional extra that the dev environment does not install; this
    # stand-in records the call the reader makes and returns rows the way a Dataset does.
    calls: list[tuple[Any, ...]] = []

    def load_dataset(name: str, config: str | None, split: str) -> Iterator[dict[str, Any]]:
        calls.append((name, config, split))
        return iter([{"question": "q0"}, {"question": ""}])

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    src = Source(hf_dataset="org/prompts", hf_config="en", hf_split="test", layout="prompt")
    reader = open_source(src, tmp_path)
    items = list(reader.read("cat"))
    assert calls == [("org/prompts", "en", "test")]
    assert isinstance(items[0], SourcePrompt) and items[0].row == 0
    assert rejected_code(items[1]) == "empty_prompt"
    assert isinstance(items[1], Rejected) and items[1].source == "hf:org/prompts/en[test]"


def test_hf_local_directory_resolves_from_base_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "localds").mkdir()
    seen: list[str] = []

    def load_dataset(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
        seen.append(name)
        return []

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    list(open_source(Source(hf_dataset="localds"), tmp_path).read("c"))
    assert seen == [str(tmp_path / "localds")]


def test_a_subclass_only_yields_raw_rows() -> None:
    class ListReader(SampleReader):
        def iter_rows(self) -> Iterator[tuple[int, object]]:  # type: ignore[override]
            yield 5, {"prompt": "hi"}
            yield 6, ["not", "a", "dict"]

    items = list(ListReader(Source(path="x", layout="prompt"), "mem").read("c"))
    assert isinstance(items[0], SourcePrompt) and items[0].messages == (user("hi"),)
    assert rejected_code(items[1]) == "not_an_object"
    assert isinstance(items[1], Rejected) and (items[1].source, items[1].row) == ("mem", 6)


# --- layouts -------------------------------------------------------------------------


def test_sharegpt_conversations_map_speaker_names(tmp_path: Path) -> None:
    conv = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "a"},
        {"from": "gpt", "value": "b"},
        {"from": "user", "value": "c"},
        {"from": "chatgpt", "value": "d"},
        {"from": "human", "value": "e"},
        {"from": "model", "value": "f"},
    ]
    item = read_one(tmp_path, {"conversations": conv}, layout="conversations")
    assert isinstance(item, SourcePrompt)
    assert [m["role"] for m in item.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert item.messages[-1] == user("e")


def test_conversations_layout_accepts_openai_shaped_turns(tmp_path: Path) -> None:
    # SpecForge's own files put {role, content} under "conversations".
    item = read_one(tmp_path, {"conversations": [user("hi")]}, layout="conversations")
    assert isinstance(item, SourcePrompt) and item.messages == (user("hi"),)


@pytest.mark.parametrize("name", ["prompt", "instruction", "question"])
def test_prompt_layout_finds_default_field_names(tmp_path: Path, name: str) -> None:
    item = read_one(tmp_path, {name: "What is 2+2?"}, layout="prompt")
    assert isinstance(item, SourcePrompt) and item.messages == (user("What is 2+2?"),)


def test_prompt_layout_prefers_prompt_over_later_names(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"question": "q", "prompt": "p"}, layout="prompt")
    assert isinstance(item, SourcePrompt) and item.messages == (user("p"),)


def test_prompt_layout_named_field(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"text": "hello", "prompt": "other"}, layout="prompt", field="text")
    assert isinstance(item, SourcePrompt) and item.messages == (user("hello"),)


def test_alpaca_instruction_takes_its_input(tmp_path: Path) -> None:
    row = {"instruction": "Translate to French.", "input": "Good morning", "output": "x"}
    item = read_one(tmp_path, row, layout="prompt")
    assert isinstance(item, SourcePrompt)
    assert item.messages == (user("Translate to French.\n\nGood morning"),)


def test_messages_under_a_custom_field(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"chat": [user("a")]}, field="chat")
    assert isinstance(item, SourcePrompt) and item.messages == (user("a"),)


def test_text_content_parts_are_joined(tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    item = read_one(tmp_path, {"messages": [{"role": "user", "content": parts}]})
    assert isinstance(item, SourcePrompt)
    assert item.messages == (user("line one\nline two"),)


# --- rejections ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "source", "code"),
    [
        ('{"messages": [', {}, "malformed_json"),
        ("[1, 2]", {}, "not_an_object"),
        ('"just a string"', {}, "not_an_object"),
        ({"prompt": "x"}, {}, "missing_field"),
        ({"text": "x"}, {"layout": "prompt"}, "missing_field"),
        ({"messages": [{"content": "x"}]}, {}, "missing_field"),
        ({"messages": [{"role": "user"}]}, {}, "missing_field"),
        ({"messages": "hello"}, {}, "wrong_type"),
        ({"messages": ["hello"]}, {}, "wrong_type"),
        ({"messages": [{"role": "user", "content": 5}]}, {}, "wrong_type"),
        ({"messages": [{"role": "user", "content": None}]}, {}, "wrong_type"),
        ({"messages": [{"role": 1, "content": "x"}]}, {}, "wrong_type"),
        ({"prompt": ["x"]}, {"layout": "prompt"}, "wrong_type"),
        ({"messages": []}, {}, "empty_prompt"),
        ({"messages": [user(" \n\t ")]}, {}, "empty_prompt"),
        ({"prompt": "   "}, {"layout": "prompt"}, "empty_prompt"),
        ({"messages": [user("a"), asst(""), user("b")]}, {}, "empty_prompt"),
        ({"messages": [{"role": "tool", "content": "x"}]}, {}, "invalid_roles"),
        ({"messages": [user("a"), {"role": "system", "content": "s"}]}, {}, "invalid_roles"),
        ({"messages": [{"role": "system", "content": "s"}]}, {}, "invalid_roles"),
        ({"messages": [asst("a"), user("b")]}, {}, "invalid_roles"),
        ({"messages": [user("a"), user("b")]}, {}, "invalid_roles"),
        ({"messages": [user("a"), asst("b"), asst("c")]}, {}, "invalid_roles"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            {},
            "non_text_content",
        ),
        ({"messages": [{"role": "user", "content": ["bare"]}]}, {}, "wrong_type"),
        ({"messages": [user("a")]}, {"id_field": "id"}, "missing_field"),
        ({"id": {"a": 1}, "messages": [user("a")]}, {"id_field": "id"}, "wrong_type"),
        ({"id": True, "messages": [user("a")]}, {"id_field": "id"}, "wrong_type"),
        ({"id": " ", "messages": [user("a")]}, {"id_field": "id"}, "missing_field"),
    ],
)
def test_each_rejection_reason(tmp_path: Path, row: Any, source: dict[str, Any], code: str) -> None:
    item = read_one(tmp_path, row, **source)
    assert rejected_code(item) == code
    assert isinstance(item, Rejected)
    assert item.category == "cat" and item.source == "p.jsonl" and item.row == 1
    # The detail after the code says what was wrong, not just which rule.
    assert len(item.reason) > len(code) + 2


def test_malformed_line_names_the_column_and_reading_continues(tmp_path: Path) -> None:
    items = read_all(tmp_path, [{"messages": [user("a")]}, '{"messages": [', {"prompt": "b"}])
    assert isinstance(items[0], SourcePrompt)
    assert isinstance(items[1], Rejected) and items[1].row == 2
    assert items[1].reason.startswith("malformed_json: ") and "column" in items[1].reason
    assert rejected_code(items[2]) == "missing_field"


def test_invalid_utf8_line_is_malformed(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    (item,) = open_source(Source(path="p.jsonl", layout="prompt"), tmp_path).read("c")
    assert rejected_code(item) == "malformed_json"


def test_duplicate_ids_rejected_after_the_first(tmp_path: Path) -> None:
    rows = [
        {"id": 7, "messages": [user("a")]},
        {"id": "7", "messages": [user("b")]},
        {"id": 8, "messages": [user("c")]},
    ]
    items = read_all(tmp_path, rows, id_field="id")
    assert isinstance(items[0], SourcePrompt) and items[0].id == "7"
    assert rejected_code(items[1]) == "duplicate_id"
    assert isinstance(items[2], SourcePrompt) and items[2].id == "8"


def test_invalid_row_does_not_claim_its_id(tmp_path: Path) -> None:
    rows = [{"id": "a", "messages": []}, {"id": "a", "messages": [user("ok")]}]
    items = read_all(tmp_path, rows, id_field="id")
    assert rejected_code(items[0]) == "empty_prompt"
    assert isinstance(items[1], SourcePrompt) and items[1].id == "a"


# --- multi-turn shaping and system prompts -------------------------------------------

CONV = [
    {"role": "system", "content": "sys"},
    user("u1"),
    asst("a1"),
    user("u2"),
    asst("a2"),
    user("u3"),
    asst("a3"),
]


def test_multi_turn_last_sends_up_to_the_last_user_turn(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": CONV}, multi_turn="last")
    assert isinstance(item, SourcePrompt)
    assert item.messages == tuple(CONV[:6])
    assert item.followups == ()


def test_multi_turn_all_sends_first_user_turn_and_keeps_the_rest(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": CONV}, multi_turn="all")
    assert isinstance(item, SourcePrompt)
    assert item.messages == (CONV[0], user("u1"))
    assert item.followups == ("u2", "u3")


def test_multi_turn_all_ignores_empty_source_replies_it_discards(tmp_path: Path) -> None:
    row = {"messages": [user("u1"), asst(""), user("u2"), asst("")]}
    assert isinstance(read_one(tmp_path, row, multi_turn="all"), SourcePrompt)
    # "last" sends the empty middle reply as context, so there it is a rejection.
    assert rejected_code(read_one(tmp_path, row, multi_turn="last")) == "empty_prompt"


def test_multi_turn_all_rejects_an_empty_followup(tmp_path: Path) -> None:
    row = {"messages": [user("u1"), asst("a"), user("  ")]}
    assert rejected_code(read_one(tmp_path, row, multi_turn="all")) == "empty_prompt"


def test_system_prompt_replaces_the_rows_own(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": CONV[:2]}, system_prompt="override")
    assert isinstance(item, SourcePrompt)
    assert item.messages == ({"role": "system", "content": "override"}, user("u1"))


def test_system_prompt_added_when_row_has_none(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": [user("u1")]}, system_prompt="override")
    assert isinstance(item, SourcePrompt)
    assert item.messages == ({"role": "system", "content": "override"}, user("u1"))


def test_row_system_message_kept_without_a_category_prompt(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": CONV[:2]})
    assert isinstance(item, SourcePrompt) and item.messages == tuple(CONV[:2])


def test_empty_system_prompt_removes_the_rows_own(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": CONV[:2]}, system_prompt="")
    assert isinstance(item, SourcePrompt) and item.messages == (user("u1"),)


def test_category_prompt_rescues_an_empty_row_system_message(tmp_path: Path) -> None:
    row = {"messages": [{"role": "system", "content": ""}, user("u1")]}
    assert rejected_code(read_one(tmp_path, row)) == "empty_prompt"
    assert isinstance(read_one(tmp_path, row, system_prompt="s"), SourcePrompt)

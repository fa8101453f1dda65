"""Token-exact export: the tiny model's own tokenizer and template, checked against the engine."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_pipeline import shard_records

from draftgen.errors import JobError
from draftgen.export import ExportOptions, export_run
from draftgen.export.base import ExportContext
from draftgen.export.token_ids import TokensFormat, server_token_ids
from draftgen.local import LocalEngine
from draftgen.reporting.status import read_status
from draftgen.sample import Message, Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter
from helpers.masks import masked_runs

DEMO_JOB = Path(__file__).resolve().parents[2] / "examples" / "demo" / "job-tiny.yaml"
END = "<|im_end|>"


def engine_prompt_ids(engine: LocalEngine, messages: list[dict[str, Any]]) -> list[int]:
    body = orjson.dumps({"model": engine.served_name, "messages": messages,
                         "add_generation_prompt": True})
    req = urllib.request.Request(f"{engine.url}/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        tokens: list[int] = orjson.loads(r.read())["tokens"]
    return tokens


def test_every_demo_sample_exports_the_ids_the_engine_returned(
    local_engine: LocalEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "demo"
    ran = subprocess.run([sys.executable, "-m", "draftgen", "run", str(DEMO_JOB),
                          "--server", local_engine.url, "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr
    everything = ExportOptions("tokens", tokenizer=str(tiny_model_dir), include_truncated=True,
                               include_flagged=True)
    s = export_run(out, tmp_path / "tokens.jsonl", everything)
    st = read_status(out)
    assert st.done > 150 and s.exported + s.empty == st.done
    records = {r["id"]: r for r in shard_records(out)}
    rows = [orjson.loads(x) for x in (tmp_path / "tokens.jsonl").read_bytes().splitlines()]
    assert len(rows) == s.exported
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    end_id = tok.convert_tokens_to_ids(END)
    differ = 0
    for row in rows:
        rec = records[row["id"]]
        ids, mask, meta = row["input_ids"], row["loss_mask"], row["metadata"]
        # The server returned the ids of every turn, and they are what is exported.
        assert meta["token_source"] == "server", row["id"]
        last = rec["turns"][-1]
        assert ids == [*last["prompt_token_ids"], *last["token_ids"]], row["id"]
        # The prompt ids are the engine's own rendering of what was sent.
        sent = [*rec["messages"]]
        for turn, follow in zip(rec["turns"], [*rec["followups"], None], strict=False):
            if follow is None:
                break
            sent += [{"role": "assistant", "content": turn["content"]},
                     {"role": "user", "content": follow}]
        assert last["prompt_token_ids"] == engine_prompt_ids(local_engine, sent), row["id"]
        # Masked: every generated id and nothing else; the end token only when emitted.
        generated = sum(len(t["token_ids"]) for t in rec["turns"])
        assert sum(mask) == generated and mask[-len(last["token_ids"]):] == [1] * len(
            last["token_ids"]), row["id"]
        for turn in rec["turns"]:
            assert len(turn["token_ids"]) == turn["completion_tokens"], row["id"]
            assert (turn["token_ids"][-1] == end_id) == (turn["finish_reason"] == "stop")
        assert tok.decode(ids, skip_special_tokens=False) == row["text"]
        differ += bool(meta.get("retokenized_differs"))
    # The tiny model writes byte soup that re-tokenises otherwise; the export says so.
    assert differ and any(f"{differ} sample(s) re-tokenise" in n for n in s.notes)


# --- without the engine: the tokenizer and template alone ------------------------------

def sample(i: int) -> Sample:
    return Sample(id=f"c-{i}", category="c", partition="short",
                  messages=({"role": "user", "content": "q"},), max_tokens=8, fingerprint="fp")


def make_run(out: Path, records: list[Record], manifest: dict[str, Any]) -> None:
    async def go() -> None:
        async with OutcomeWriter(out) as w:
            for r in records:
                await w.put(r)

    with RunStore.open(out) as store:
        store.write_plan([sample(i) for i in range(len(records))], [])
        store.write_manifest(manifest)
    asyncio.run(go())


def rec(i: int, messages: list[Message], turns: list[tuple[str, str]],
        followups: tuple[str, ...] = ()) -> Record:
    return Record(f"c-{i}", "fp", "c", "short", tuple(messages), followups,
                  tuple(Turn(c, None, f, 10, 5, 0.1, 1.0) for c, f in turns), "http://x", 1, 1.0)


def export_rows(out: Path, opts: ExportOptions) -> list[dict[str, Any]]:
    to = out / "tokens.jsonl"
    export_run(out, to, opts)
    return [orjson.loads(x) for x in to.read_bytes().splitlines()]


def decoded_runs(tiny_model_dir: Path, row: dict[str, Any]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return [str(tok.decode(r, skip_special_tokens=False))
            for r in masked_runs(row["input_ids"], row["loss_mask"])]


def test_only_generated_turns_are_masked_and_a_cut_turn_has_no_end_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    source_turn = [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "an old answer from the dataset"},
                   {"role": "user", "content": "and now?"}]
    records = [
        rec(0, source_turn, [("a new answer", "stop")]),
        # multi_turn: all — two generated turns, the second cut by max_tokens.
        rec(1, [{"role": "user", "content": "first"}], [("one", "stop"), ("two, cut", "length")],
            followups=("second",)),
    ]
    make_run(tmp_path, records, {"job": {"model": "tiny"}})
    rows = export_rows(tmp_path, ExportOptions("tokens", tokenizer=str(tiny_model_dir),
                                               include_truncated=True))
    assert decoded_runs(tiny_model_dir, rows[0]) == ["a new answer" + END]
    assert decoded_runs(tiny_model_dir, rows[1]) == ["one" + END, "two, cut"]
    assert rows[1]["metadata"]["finish_reason"] == "length"
    assert rows[1]["metadata"]["usage"] == {"prompt_tokens": 10, "completion_tokens": 10}


def thinking_tokenizer(tiny_model_dir: Path, dest: Path) -> Path:
    """The tiny tokenizer with a template like Qwen3's: a `thinking` switch, and earlier
    turns' reasoning dropped (so rendering is not incremental)."""
    dest.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, dest / name)
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{%- if thinking %}{{- '<|im_start|>system\\nthink mode<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- set content = message['content'] %}"
        "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
        "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def test_template_kwargs_reach_the_template_and_rewritten_turns_are_still_found(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tok_dir = thinking_tokenizer(tiny_model_dir, tmp_path / "tok")
    out = tmp_path / "run"
    records = [Record("c-0", "fp", "c", "short", ({"role": "user", "content": "first"},),
                      ("second",),
                      (Turn("one", "r1", "stop", 10, 5, 0.1, 1.0),
                       Turn("two", "r2", "stop", 20, 5, 0.1, 1.0)), "http://x", 1, 1.0)]
    make_run(out, records, {"job": {"model": "tiny", "sampling": {
        "extra_body": {"chat_template_kwargs": {"thinking": True}}}}})
    (row,) = export_rows(out, ExportOptions("tokens", tokenizer=str(tok_dir)))
    assert row["text"].startswith("<|im_start|>system\nthink mode")
    assert row["metadata"]["chat_template_kwargs"] == {"thinking": True}
    # This template renders no reasoning_content, so reasoning goes inline in the common
    # convention. The first turn's reasoning is not in the training text (the template cuts
    # it at </think>, keeping the newlines after it), so its mask covers what remains; the
    # last turn keeps its inline reasoning.
    assert decoded_runs(tiny_model_dir, row) == [
        "\n\none" + END, "<think>\nr2\n</think>\n\ntwo" + END]


def test_a_tokenizer_named_by_the_job_is_found_relative_to_the_job_file(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    job_dir = tmp_path / "jobs"
    shutil.copytree(tiny_model_dir, job_dir / "model")
    make_run(tmp_path / "run", [rec(0, [{"role": "user", "content": "q"}], [("a", "stop")])],
             {"job_file": str(job_dir / "job.yaml"),
              "job": {"model": "tiny", "tokenizer": "model/tokenizer.json"}})
    (row,) = export_rows(tmp_path / "run", ExportOptions("tokens"))
    assert decoded_runs(tiny_model_dir, row) == ["a" + END]


def test_without_a_tokenizer_the_export_says_how_to_give_one(tmp_path: Path) -> None:
    make_run(tmp_path, [rec(0, [{"role": "user", "content": "q"}], [("a", "stop")])],
             {"job": {"model": "tiny"}})
    with pytest.raises(JobError, match="--tokenizer"):
        export_run(tmp_path, tmp_path / "t.jsonl", ExportOptions("tokens"))
    with pytest.raises(JobError, match="cannot be loaded"):
        export_run(tmp_path, tmp_path / "t.jsonl",
                   ExportOptions("tokens", tokenizer=str(tmp_path / "nothing-here")))


def test_server_token_ids_are_used_as_they_are_when_a_record_has_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    fmt = TokensFormat()
    opts = ExportOptions("tokens", tokenizer=str(tiny_model_dir))
    fmt.prepare(ExportContext(tmp_path, {}), opts)
    turn = {"content": "hi", "reasoning": None, "finish_reason": "stop", "prompt_tokens": 3,
            "completion_tokens": 2, "prompt_token_ids": [1, 50, 201], "token_ids": [60, 2]}
    record = {"id": "c-0", "category": "c", "partition": "short", "server": "http://x",
              "messages": [{"role": "user", "content": "q"}], "followups": [],
              "turns": [turn]}
    row = fmt.row(record, opts)
    assert (row["input_ids"], row["loss_mask"]) == ([1, 50, 201, 60, 2], [0, 0, 0, 1, 1])
    assert row["metadata"]["token_source"] == "server"
    # Multi-turn: an earlier answer is masked where its ids reappear in the last prompt...
    second = {**turn, "prompt_token_ids": [1, 50, 201, 60, 2, 7, 8], "token_ids": [61, 2]}
    assert server_token_ids({**record, "turns": [turn, second]}) == (
        [1, 50, 201, 60, 2, 7, 8, 61, 2], [0, 0, 0, 1, 1, 0, 0, 1, 1])
    # ...and a template that rewrote it (ids not found) is rendered instead.
    rewritten = {**second, "prompt_token_ids": [1, 50, 201, 99, 7, 8]}
    assert server_token_ids({**record, "turns": [turn, rewritten]}) is None
    assert server_token_ids({**record, "turns": [{"content": "x"}]}) is None

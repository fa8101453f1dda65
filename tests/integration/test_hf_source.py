"""A real Hugging Face `datasets` source (a local dataset folder; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from draftgen.job import load_job
from draftgen.planning.plan import build_plan


def test_a_local_hf_dataset_is_planned_like_any_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = tmp_path / "myset"
    ds.mkdir()
    rows = [{"uid": f"u{i}", "question": f"What is {i} squared?"} for i in range(5)]
    rows.append({"uid": "u5", "question": "   "})  # set aside: empty prompt
    (ds / "test.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    (tmp_path / "job.yaml").write_text(
        "model: m\npartitions: {p: {max_tokens: 8}}\n"
        "categories:\n  - {name: hf, source: {hf_dataset: myset, hf_split: test,"
        " layout: prompt, field: question, id_field: uid}}\n"
    )
    plan = build_plan(load_job(tmp_path / "job.yaml"))
    assert sorted(s.id for s in plan.samples) == [f"hf-u{i}" for i in range(5)]
    assert plan.samples[0].messages[-1]["content"].startswith("What is")
    assert [r.reason.split(":")[0] for r in plan.rejected] == ["empty_prompt"]

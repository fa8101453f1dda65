"""Caps that fit a time budget, and writing them into a job file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from draftgen.errors import JobError
from draftgen.job import load_job
from draftgen.planning.budget import category_prompts, fit_caps, propose_caps, write_job_with_caps
from draftgen.planning.capacity import predict
from draftgen.planning.plan import build_plan
from draftgen.planning.workload import DecodeSpeed, ServerCapacity, Workload

FLAT = DecodeSpeed(((1, 100.0), (1000, 100_000.0)))  # 10 ms a step at any batch
SERVER = ServerCapacity(10**6, FLAT)


def two_categories(n: int = 200) -> tuple[list[dict[str, Any]], Workload]:
    """A and B, n samples of 100 tokens each, 4 at a time: each sample costs 0.25 s."""
    w = Workload(("A",) * n + ("B",) * n, ("p",) * (2 * n), (10,) * (2 * n),
                 (100,) * (2 * n), {"p": 4}, {("A", "p"): (100,), ("B", "p"): (100,)})
    rows = [{"category": c, "partition": "p", "prompts": n, "samples": n} for c in "AB"]
    return rows, w


def test_a_plan_that_fits_keeps_everything() -> None:
    rows, w = two_categories()
    pred = predict(SERVER, w)
    assert pred.duration_s == pytest.approx(100.0)
    plan = fit_caps(rows, pred, 100.0)
    assert plan.caps == {"A": 200, "B": 200}
    assert plan.reduced == {}
    assert plan.fits


def test_proportional_caps_shrink_every_category_alike_to_fit() -> None:
    rows, w = two_categories()
    plan = fit_caps(rows, predict(SERVER, w), 50.0)
    assert plan.fits
    assert plan.prediction.duration_s <= 50.0
    assert plan.caps["A"] == plan.caps["B"]
    assert 95 <= plan.caps["A"] <= 100  # 200 samples × 0.25 s = 50 s
    assert plan.reduced == plan.caps


def test_priority_keeps_the_first_whole_and_caps_the_next() -> None:
    rows, w = two_categories()
    plan = fit_caps(rows, predict(SERVER, w), 60.0, mode="priority", priority=["B"])
    assert plan.fits
    assert plan.caps["B"] == 200  # 50 s
    assert 36 <= plan.caps["A"] <= 40  # the other 10 s
    assert plan.reduced == {"A": plan.caps["A"]}


def test_priority_drops_categories_after_the_one_that_does_not_fit() -> None:
    rows, w = two_categories()
    rows.append({"category": "C", "partition": "p", "prompts": 0, "samples": 0})
    plan = fit_caps(rows, predict(SERVER, w), 20.0, mode="priority", priority=["A"])
    assert 76 <= plan.caps["A"] <= 80
    assert plan.caps["B"] == 0
    assert plan.caps["C"] == 0


def test_a_budget_too_small_for_anything_caps_everything_to_zero() -> None:
    rows, w = two_categories()
    caps = propose_caps(rows, predict(SERVER, w), 0.1)
    assert caps == {"A": 0, "B": 0}


def test_caps_count_prompts_not_samples() -> None:
    rows, w = two_categories()
    rows = [{**r, "prompts": 100} for r in rows]  # samples_per_prompt 2
    plan = fit_caps(rows, predict(SERVER, w), 50.0)
    assert 47 <= plan.caps["A"] <= 50
    assert plan.prompts == {"A": 100, "B": 100}


def test_bad_arguments_are_refused() -> None:
    rows, w = two_categories()
    pred = predict(SERVER, w)
    with pytest.raises(ValueError, match="unknown categories"):
        fit_caps(rows, pred, 10.0, mode="priority", priority=["Z"])
    with pytest.raises(ValueError, match="mode"):
        fit_caps(rows, pred, 10.0, mode="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        fit_caps(rows, pred, 0.0)


def test_category_prompts_sums_partition_rows() -> None:
    rows = [{"category": "A", "partition": "short", "prompts": 3, "samples": 6},
            {"category": "A", "partition": "long", "prompts": 1, "samples": 2},
            {"category": "B", "partition": "auto", "prompts": 0, "samples": 0}]
    assert category_prompts(rows) == {"A": (4, 8), "B": (0, 0)}


def _write_job(root: Path, n: int = 60) -> Path:
    data = root / "data"
    data.mkdir()
    for cat in ("a", "b"):
        lines = [orjson.dumps({"messages": [{"role": "user",
                                             "content": f"{cat} prompt {i} " + "x " * (i % 9)}]})
                 for i in range(n)]
        (data / f"{cat}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    job = root / "job.yaml"
    job.write_text(
        "# my job\n"
        "model: m\n"
        "sampling: {temperature: 0.5, seed: 3}\n"
        "partitions:\n"
        "  short: {max_tokens: 100, concurrency: 4}\n"
        "categories:\n"
        "  - {name: a, source: {path: data/a.jsonl}, partition: short}\n"
        "  - {name: b, source: {path: data/b.jsonl}, partition: short, cap: 50}\n",
        encoding="utf-8")
    return job


def test_written_job_keeps_its_content_and_plans_exactly_the_capped_prefix(
        tmp_path: Path) -> None:
    job_path = _write_job(tmp_path)
    job = load_job(job_path)
    plan = build_plan(job)
    w = Workload.from_samples(plan.samples, {"short": 4}, {("a", "short"): (80,),
                                                           ("b", "short"): (40,)})
    pred = predict(SERVER, w)
    capped = fit_caps(plan.summary_rows(), pred, pred.duration_s / 2)
    assert capped.fits
    assert capped.prompts == {"a": 60, "b": 50}

    new_path = write_job_with_caps(job_path, capped.caps, tmp_path / "sub" / "capped.yaml")
    text = new_path.read_text(encoding="utf-8")
    assert text.startswith("# Written by draftgen")
    assert "comments" in text.splitlines()[1]
    raw = yaml.safe_load(text)
    assert raw["sampling"] == {"temperature": 0.5, "seed": 3}
    assert [c["cap"] for c in raw["categories"]] == [capped.caps["a"], capped.caps["b"]]
    new_job = load_job(new_path)
    # Paths still point at the same files and the same output directory.
    moved = new_job.resolve(new_job.categories[0].source.path or "")
    assert moved.resolve() == (tmp_path / "data/a.jsonl").resolve()
    assert new_job.resolve(new_job.output).resolve() == job.resolve(job.output).resolve()

    new_plan = build_plan(new_job)
    counts = {c: sum(1 for s in new_plan.samples if s.category == c) for c in "ab"}
    assert counts == capped.caps
    # A cap keeps a prefix of the category's samples: the prediction made while fitting is
    # exactly the prediction for the capped job's plan.
    again = predict(SERVER, Workload.from_samples(new_plan.samples, {"short": 4},
                                                  w.output_samples))
    assert again.duration_s == pytest.approx(capped.prediction.duration_s)
    seen = dict.fromkeys("ab", 0)
    prefix = []
    for s in plan.samples:
        seen[s.category] += 1
        if seen[s.category] <= capped.caps[s.category]:
            prefix.append(s.id)
    assert [s.id for s in new_plan.samples] == prefix


def test_writing_caps_for_unknown_categories_fails(tmp_path: Path) -> None:
    job_path = _write_job(tmp_path)
    with pytest.raises(JobError, match="unknown categories"):
        write_job_with_caps(job_path, {"zzz": 1}, tmp_path / "out.yaml")
    assert not (tmp_path / "out.yaml").exists()


def test_fitting_needs_few_simulations(monkeypatch: pytest.MonkeyPatch) -> None:
    import draftgen.planning.budget as budget

    rows, w = two_categories(2000)
    pred = predict(SERVER, w)
    calls = 0

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return predict(*args, **kwargs)

    monkeypatch.setattr(budget, "predict", counting)
    plan = fit_caps(rows, pred, 0.37 * pred.duration_s)
    assert plan.fits
    assert plan.prediction.duration_s > 0.36 * pred.duration_s
    assert calls <= 8

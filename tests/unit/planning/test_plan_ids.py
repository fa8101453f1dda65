"""Sample ids: unique across the whole plan, the same on every build, natural where they can be."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from test_plan import cat, make_job, prompts, user, write_rows

from draftgen.job import JobSpec
from draftgen.planning import plan as plan_module
from draftgen.planning.plan import Plan, build_plan
from draftgen.sample import content_digest
from draftgen.sources import reason_code


def with_ids(tmp_path: Path, name: str, rows: list[tuple[str, str]]) -> dict[str, Any]:
    """A category reading `name`.jsonl, whose rows are (id, prompt text)."""
    data = [{"id": i, "messages": [user(t)]} for i, t in rows]
    path = write_rows(tmp_path / f"{name}.jsonl", data)
    return cat(name, path, source={"path": path, "id_field": "id"})


def digest_of(text: str) -> str:
    return content_digest([user(text)], [])


def natural(category: str, key: str, spp: int) -> list[str]:
    return [f"{category}-{key}-{k}" for k in range(spp)] if spp > 1 else [f"{category}-{key}"]


def ids_of(plan: Plan, text: str) -> list[str]:
    return [s.id for s in plan.samples if s.messages[-1]["content"] == text]


def id_warnings(plan: Plan) -> list[str]:
    return [w for w in plan.warnings if "sample id" in w]


def build(tmp_path: Path, categories: list[dict[str, Any]], **spec: Any) -> tuple[JobSpec, Plan]:
    job = make_job(tmp_path, categories, **spec)
    return job, build_plan(job)


@pytest.mark.parametrize("spp", [1, 2, 3])
@pytest.mark.parametrize("later_first", [False, True])
def test_ids_that_would_collide_across_categories_are_made_unique(
    tmp_path: Path, spp: int, later_first: bool
) -> None:
    # Category `a` with id `b-1` and category `a-b` with id `1` both read as `a-b-1`.
    a = with_ids(tmp_path, "a", [("b-1", "from a"), ("solo", "a solo")])
    ab = with_ids(tmp_path, "a-b", [("1", "from a-b"), ("2", "a-b two")])
    categories = [ab, a] if later_first else [a, ab]
    job, plan = build(tmp_path, categories, samples_per_prompt=spp)

    ids = [s.id for s in plan.samples]
    assert len(ids) == len(set(ids)) == 4 * spp
    # Whichever category comes first keeps the id; only the later one changes.
    first, later = ("from a-b", "from a") if later_first else ("from a", "from a-b")
    (first_cat, first_key), (later_cat, later_key) = sorted(
        [("a", "b-1"), ("a-b", "1")], reverse=later_first
    )
    assert ids_of(plan, first) == natural(first_cat, first_key, spp)
    assert ids_of(plan, later) == natural(
        later_cat, f"{later_key}-{digest_of(later)[:12]}", spp
    )
    # Ids that collide with nothing are what they always were.
    assert ids_of(plan, "a solo") == natural("a", "solo", spp)
    assert ids_of(plan, "a-b two") == natural("a-b", "2", spp)
    # The source's own id is kept as it was for exports.
    assert {s.source_id for s in plan.samples if s.messages[-1]["content"] == later} == {
        f"{later_key}-{k}" if spp > 1 else later_key for k in range(spp)
    }
    (warning,) = id_warnings(plan)
    assert warning.startswith("1 prompt(s)")
    assert repr(natural("a-b", "1", spp)[0]) in warning
    assert "a.jsonl:1" in warning and "a-b.jsonl:1" in warning
    # The same job and sources give the same ids on every build.
    assert [s.id for s in build_plan(job).samples] == ids


def test_no_collision_no_warning_and_natural_ids(tmp_path: Path) -> None:
    a = with_ids(tmp_path, "a", [("x", "one"), ("y", "two")])
    b = with_ids(tmp_path, "b", [("x", "three")])
    _, plan = build(tmp_path, [a, b])
    assert sorted(s.id for s in plan.samples) == ["a-x", "a-y", "b-x"]
    assert plan.warnings == []


def test_disambiguation_never_reuses_a_taken_id(tmp_path: Path) -> None:
    # Category `c` already holds every id the later prompt's first candidates would take.
    d = digest_of("later")
    c = with_ids(
        tmp_path,
        "c",
        [("x-k", "one"), (f"x-k-{d[:12]}", "two"), (f"x-k-{d}", "three")],
    )
    cx = with_ids(tmp_path, "c-x", [("k", "later")])
    _, plan = build(tmp_path, [c, cx])
    ids = [s.id for s in plan.samples]
    assert len(set(ids)) == 4
    assert ids_of(plan, "later") == [f"c-x-k-{d}-1"]
    assert sorted(ids_of(plan, t)[0] for t in ("one", "two", "three")) == sorted(
        ["c-x-k", f"c-x-k-{d[:12]}", f"c-x-k-{d}"]
    )


def test_digest_prefix_collisions_take_the_whole_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One hex character of key: 17 prompts must share one, as 12 characters vanishingly might.
    monkeypatch.setattr(plan_module, "KEY_HEX_CHARS", 1)
    texts = [f"q{i}" for i in range(17)]
    write_rows(tmp_path / "a.jsonl", prompts(texts))
    job, plan = build(tmp_path, [cat("a", "a.jsonl")])
    ids = [s.id for s in plan.samples]
    assert len(set(ids)) == 17
    short = 0
    for text in texts:
        (sid,) = ids_of(plan, text)
        d = digest_of(text)
        assert sid in (f"a-{d[:1]}", f"a-{d}")
        short += sid == f"a-{d[:1]}"
    # One prompt per distinct first character keeps the short id; the rest were renamed.
    assert short == len({digest_of(t)[0] for t in texts})
    (warning,) = id_warnings(plan)
    assert warning.startswith(f"{17 - short} prompt(s)")
    assert [s.id for s in build_plan(job).samples] == ids


@pytest.mark.parametrize("spp", [1, 2])
def test_ids_unique_across_many_dashed_categories_and_ids(tmp_path: Path, spp: int) -> None:
    names = ["a", "a-b", "a-b-c", "a-b-c-1"]
    keys = ["1", "c", "b-c", "c-1", "b-c-1", "1-0", "0", "c-1-0", "b", "1-1"]
    categories = []
    expected: dict[str, list[str]] = {}
    for name in names:
        rows = [(k, f"{name}/{k}") for k in keys]
        categories.append(with_ids(tmp_path, name, rows))
        expected |= {text: natural(name, k, spp) for k, text in rows}
    _, plan = build(tmp_path, categories, samples_per_prompt=spp)
    ids = [s.id for s in plan.samples]
    assert len(ids) == len(set(ids)) == len(names) * len(keys) * spp
    renamed = [t for t in expected if ids_of(plan, t) != expected[t]]
    assert renamed  # the names and keys above do collide
    # A natural id is only given up when an earlier sample (in plan order) holds it.
    earlier: set[str] = set()
    for s in plan.samples:
        text = s.messages[-1]["content"]
        if text in renamed:
            assert set(expected[text]) & earlier
        earlier.add(s.id)
    (warning,) = id_warnings(plan)
    assert warning.startswith(f"{len(renamed)} prompt(s)")


def test_a_repeated_source_id_in_one_category_is_rejected_not_reused(tmp_path: Path) -> None:
    a = with_ids(tmp_path, "a", [("7", "first"), ("7", "second"), ("8", "third")])
    _, plan = build(tmp_path, [a])
    assert sorted(s.id for s in plan.samples) == ["a-7", "a-8"]
    assert ids_of(plan, "first") == ["a-7"]
    (rej,) = plan.rejected
    assert (reason_code(rej.reason), rej.row) == ("duplicate_id", 2)
    assert plan.stats[("a", "short")].rejected == 1


def test_ids_unique_for_every_small_combination(tmp_path: Path) -> None:
    # Every pairing of two short dashed names with two short dashed ids.
    parts = ["x", "x-1", "1", "1-x"]
    for i, (n1, n2) in enumerate(itertools.permutations(parts, 2)):
        folder = tmp_path / str(i)
        folder.mkdir()
        c1 = with_ids(folder, n1, [(k, f"{n1}/{k}") for k in parts])
        c2 = with_ids(folder, n2, [(k, f"{n2}/{k}") for k in parts])
        for spp in (1, 2):
            _, plan = build(folder, [c1, c2], samples_per_prompt=spp)
            ids = [s.id for s in plan.samples]
            assert len(ids) == len(set(ids)) == 2 * len(parts) * spp, (n1, n2, spp)

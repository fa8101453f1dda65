"""Building the plan: dedup, caps, routing, ids, seeds, fingerprints and the summary."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from draftgen.errors import JobError
from draftgen.job import JobSpec, load_job
from draftgen.planning.plan import Plan, build_plan, route
from draftgen.planning.tokens import MESSAGE_OVERHEAD_TOKENS, TokenCounter
from draftgen.sources import reason_code

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo" / "job.yaml"


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def write_rows(path: Path, rows: list[Any]) -> str:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path.name


def prompts(texts: list[str]) -> list[dict[str, Any]]:
    return [{"messages": [user(t)]} for t in texts]


def make_job(tmp_path: Path, categories: list[dict[str, Any]], **spec: Any) -> JobSpec:
    doc = {
        "model": "m",
        "partitions": {"short": {"max_tokens": 16}, "long": {"max_tokens": 64}},
        "categories": categories,
        **spec,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_job(path)


def cat(name: str, path: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "source": {"path": path}, "partition": "short", **kw}


def contents(plan: Plan, category: str | None = None) -> list[str]:
    return [
        s.messages[-1]["content"]
        for s in plan.samples
        if category is None or s.category == category
    ]


def test_samples_follow_category_order_and_carry_their_source(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["a1", "a2", "a3"]))
    write_rows(tmp_path / "b.jsonl", prompts(["b1", "b2"]))
    plan = build_plan(make_job(tmp_path, [cat("b", "b.jsonl"), cat("a", "a.jsonl")]))
    assert [s.category for s in plan.samples] == ["b", "b", "a", "a", "a"]
    assert sorted(contents(plan, "a")) == ["a1", "a2", "a3"]
    by_content = {s.messages[-1]["content"]: s for s in plan.samples}
    assert by_content["a2"].source == "a.jsonl:2"
    assert by_content["b1"].max_tokens == 16 and by_content["b1"].partition == "short"


def test_plan_is_deterministic(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts([f"q{i}" for i in range(50)]))
    job = make_job(tmp_path, [cat("a", "a.jsonl", cap=10)], sampling={"seed": 3})
    first, second = build_plan(job), build_plan(job)
    assert first.samples == second.samples
    assert len({s.id for s in first.samples}) == 10


def test_duplicates_removed_first_category_keeps_its_copy(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["same", "a-only", "a-only"]))
    write_rows(tmp_path / "b.jsonl", prompts(["b-only", "same"]))
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl"), cat("b", "b.jsonl")]))
    assert sorted(contents(plan, "a")) == ["a-only", "same"]
    assert contents(plan, "b") == ["b-only"]
    assert plan.stats[("a", "short")].duplicates == 1
    assert plan.stats[("b", "short")].duplicates == 1
    assert plan.rejected == []


def test_prompt_capped_out_of_a_category_is_kept_by_a_later_one(tmp_path: Path) -> None:
    texts = [f"q{i}" for i in range(6)]
    write_rows(tmp_path / "a.jsonl", prompts(texts))
    job = make_job(tmp_path, [cat("a", "a.jsonl", cap=2), cat("b", "a.jsonl")])
    plan = build_plan(job)
    in_a = contents(plan, "a")
    # Every prompt is planned exactly once: b drops only the copies a kept.
    assert sorted(contents(plan)) == texts
    assert sorted(contents(plan, "b")) == sorted(set(texts) - set(in_a))
    a, b = plan.stats[("a", "short")], plan.stats[("b", "short")]
    assert (a.prompts, a.capped, a.duplicates) == (2, 4, 0)
    assert (b.prompts, b.capped, b.duplicates) == (4, 0, 2)
    assert build_plan(job).samples == plan.samples


def test_duplicates_within_a_category_go_before_its_cap(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["x", "x", "x", "y"]))
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl", cap=2)]))
    assert sorted(contents(plan)) == ["x", "y"]
    st = plan.stats[("a", "short")]
    assert (st.duplicates, st.capped) == (2, 0)


def test_prompt_below_every_minimum_stays_free_for_a_later_category(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["tiny", "x" * 400]))
    job = make_job(
        tmp_path,
        [{"name": "a", "source": {"path": "a.jsonl"}}, cat("b", "a.jsonl", partition="long")],
        partitions={"long": {"max_tokens": 8, "min_prompt_tokens": 50}},
    )
    plan = build_plan(job)
    assert contents(plan, "a") == ["x" * 400]
    assert contents(plan, "b") == ["tiny"]
    assert plan.stats[("b", "long")].duplicates == 1
    assert [reason_code(r.reason) for r in plan.rejected] == ["no_partition"]


def test_different_system_prompts_are_not_duplicates(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["same"]))
    cats = [cat("a", "a.jsonl"), cat("b", "a.jsonl", system_prompt="be terse")]
    plan = build_plan(make_job(tmp_path, cats))
    assert len(plan.samples) == 2
    assert plan.samples[1].messages[0] == {"role": "system", "content": "be terse"}


def test_followups_distinguish_otherwise_equal_prompts(tmp_path: Path) -> None:
    rows = [
        {"messages": [user("u1"), {"role": "assistant", "content": "a"}, user("u2")]},
        {"messages": [user("u1"), {"role": "assistant", "content": "a"}, user("u3")]},
        {"messages": [user("u1")]},
    ]
    write_rows(tmp_path / "a.jsonl", rows)
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl")], multi_turn="all"))
    assert sorted(s.followups for s in plan.samples) == [(), ("u2",), ("u3",)]


def test_cap_keeps_a_seeded_shuffle(tmp_path: Path) -> None:
    texts = [f"q{i:03d}" for i in range(100)]
    write_rows(tmp_path / "a.jsonl", prompts(texts))

    def chosen(seed: int, name: str = "a") -> list[str]:
        job = make_job(tmp_path, [cat(name, "a.jsonl", cap=10)], seed=seed)
        plan = build_plan(job)
        assert plan.stats[(name, "short")].capped == 90
        return contents(plan)

    assert chosen(1) == chosen(1)
    assert chosen(1) != chosen(2)
    assert set(chosen(1)) != set(chosen(2))
    # The category's name is part of the seed, so two categories draw differently.
    assert chosen(1, "a") != chosen(1, "other")
    # Not simply the first rows of the file.
    assert chosen(1) != texts[:10]


def test_cap_larger_than_source_keeps_everything(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["x", "y"]))
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl", cap=5)]))
    assert sorted(contents(plan)) == ["x", "y"]
    assert plan.stats[("a", "short")].capped == 0


def test_route_picks_largest_minimum_reached_ties_to_first() -> None:
    job = JobSpec.model_validate(
        {
            "model": "m",
            "partitions": {
                "a": {"max_tokens": 1, "min_prompt_tokens": 0},
                "b": {"max_tokens": 1, "min_prompt_tokens": 100},
                "b2": {"max_tokens": 1, "min_prompt_tokens": 100},
                "c": {"max_tokens": 1, "min_prompt_tokens": 50},
            },
            "categories": [{"name": "x", "source": {"path": "x"}}],
        }
    )
    assert route(job.partitions, 0) == "a"
    assert route(job.partitions, 49) == "a"
    assert route(job.partitions, 50) == "c"
    assert route(job.partitions, 99) == "c"
    assert route(job.partitions, 100) == "b"
    assert route(job.partitions, 10_000) == "b"


def test_auto_partition_routes_by_prompt_tokens(tmp_path: Path) -> None:
    # Estimated tokens: ceil(chars/4) + 4, so 396 chars -> 103 and 392 chars -> 102.
    write_rows(tmp_path / "a.jsonl", prompts(["s" * 392, "l" * 396, "tiny"]))
    job = make_job(
        tmp_path,
        [{"name": "a", "source": {"path": "a.jsonl"}}],
        partitions={
            "short": {"max_tokens": 16},
            "long": {"max_tokens": 64, "min_prompt_tokens": 103},
        },
    )
    plan = build_plan(job, TokenCounter.estimate())
    by_part = {
        s.messages[0]["content"][0]: (s.partition, s.max_tokens, s.prompt_tokens)
        for s in plan.samples
    }
    assert by_part["s"] == ("short", 16, 102)
    assert by_part["l"] == ("long", 64, 103)
    assert by_part["t"][0] == "short"
    rows = {(r["category"], r["partition"]): r for r in plan.summary_rows()}
    assert rows[("a", "short")]["prompts"] == 2
    assert rows[("a", "long")]["prompts"] == 1
    assert rows[("a", "long")]["max_output_tokens"] == 64
    # Nothing was dropped before routing, so no "auto" row clutters the summary.
    assert ("a", "auto") not in rows


def test_prompt_below_every_minimum_is_rejected(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["tiny", "x" * 400]))
    job = make_job(
        tmp_path,
        [{"name": "a", "source": {"path": "a.jsonl"}}],
        partitions={"long": {"max_tokens": 8, "min_prompt_tokens": 50}},
    )
    plan = build_plan(job)
    assert len(plan.samples) == 1
    (rej,) = plan.rejected
    assert reason_code(rej.reason) == "no_partition" and rej.row == 1
    assert plan.stats[("a", "auto")].rejected == 1


def test_fixed_partition_ignores_minimums(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["tiny"]))
    job = make_job(
        tmp_path,
        [cat("a", "a.jsonl", partition="long")],
        partitions={"short": {"max_tokens": 8}, "long": {"max_tokens": 9, "min_prompt_tokens": 99}},
    )
    (s,) = build_plan(job).samples
    assert (s.partition, s.max_tokens) == ("long", 9)


def test_ids_from_hash_of_what_is_sent(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["hello"]))
    (s,) = build_plan(make_job(tmp_path, [cat("a", "a.jsonl")])).samples
    canonical = orjson.dumps(
        {"messages": [user("hello")], "followups": []}, option=orjson.OPT_SORT_KEYS
    )
    assert s.id == "a-" + hashlib.sha256(canonical).hexdigest()[:12]


def test_ids_from_id_field(tmp_path: Path) -> None:
    rows = [{"id": 41, "messages": [user("x")]}, {"id": "k", "messages": [user("y")]}]
    write_rows(tmp_path / "a.jsonl", rows)
    plan = build_plan(
        make_job(tmp_path, [cat("a", "a.jsonl", source={"path": "a.jsonl", "id_field": "id"})])
    )
    assert sorted(s.id for s in plan.samples) == ["a-41", "a-k"]


def test_samples_per_prompt_expands_ids_and_seeds(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", [{"id": "p", "messages": [user("x")]}])
    source = {"path": "a.jsonl", "id_field": "id"}
    job = make_job(
        tmp_path,
        [cat("a", "a.jsonl", source=source)],
        samples_per_prompt=3,
        sampling={"seed": 1234},
    )
    plan = build_plan(job)
    assert [(s.id, s.seed) for s in plan.samples] == [
        ("a-p-0", 1234),
        ("a-p-1", 1235),
        ("a-p-2", 1236),
    ]
    assert len({s.fingerprint for s in plan.samples}) == 3
    st = plan.stats[("a", "short")]
    assert (st.prompts, st.samples, st.max_output_tokens) == (1, 3, 48)
    assert st.prompt_tokens == 3 * plan.samples[0].prompt_tokens


def test_one_sample_per_prompt_has_no_suffix_and_no_seed_unless_set(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", [{"id": "p", "messages": [user("x")]}])
    source = {"path": "a.jsonl", "id_field": "id"}
    (s,) = build_plan(make_job(tmp_path, [cat("a", "a.jsonl", source=source)])).samples
    assert (s.id, s.seed) == ("a-p", None)
    spp = make_job(tmp_path, [cat("a", "a.jsonl", source=source)], samples_per_prompt=2)
    assert [(s.id, s.seed) for s in build_plan(spp).samples] == [("a-p-0", None), ("a-p-1", None)]


def test_fingerprint_follows_what_shapes_the_output(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["x"]))

    def fp(**spec: Any) -> str:
        (s,) = build_plan(make_job(tmp_path, [cat("a", "a.jsonl")], **spec)).samples
        assert s.fingerprint
        return s.fingerprint

    base = fp(sampling={"temperature": 0.7})
    assert fp(sampling={"temperature": 0.7}) == base
    assert fp(sampling={"temperature": 0.8}) != base
    assert fp(sampling={"temperature": 0.7, "seed": 1}) != base
    assert fp(sampling={"temperature": 0.7, "extra_body": {"top_k": 5}}) != base
    assert fp(sampling={"temperature": 0.7}, model="other") != base
    assert fp(sampling={"temperature": 0.7}, partitions={"short": {"max_tokens": 17}}) != base
    # The job seed only orders and caps; it does not change a sample's request.
    assert fp(sampling={"temperature": 0.7}, seed=99) == base


def test_followup_tokens_count_toward_prompt_tokens(tmp_path: Path) -> None:
    row = {"messages": [user("abcd"), {"role": "assistant", "content": "r"}, user("efgh")]}
    write_rows(tmp_path / "a.jsonl", [row])
    (s,) = build_plan(make_job(tmp_path, [cat("a", "a.jsonl")], multi_turn="all")).samples
    assert s.followups == ("efgh",)
    assert s.prompt_tokens == 2 * (1 + MESSAGE_OVERHEAD_TOKENS)


def test_rejections_and_summary(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", [*prompts(["x", "y", "x", "z"]), "{bad", {"messages": []}])
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl", cap=1)]))
    assert plan.rejected_by_reason() == {"empty_prompt": 1, "malformed_json": 1}
    assert [r.row for r in plan.rejected] == [5, 6]
    st = plan.stats[("a", "short")]
    assert (st.rows_read, st.rejected, st.duplicates, st.capped, st.prompts) == (6, 2, 1, 2, 1)
    (row,) = plan.summary_rows()
    assert row == {
        "category": "a",
        "partition": "short",
        "prompts": 1,
        "samples": 1,
        "rejected": 2,
        "duplicates": 1,
        "capped": 2,
        "prompt_tokens": plan.samples[0].prompt_tokens,
        "max_output_tokens": 16,
    }
    totals = plan.totals()
    assert totals["samples"] == 1 and totals["rows_read"] == 6 and totals["category"] == "total"


def test_empty_source_still_has_a_summary_row(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("")
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl")]))
    assert plan.samples == []
    assert [r["category"] for r in plan.summary_rows()] == ["a"]
    assert plan.warnings == ["category a: source a.jsonl gave no rows"]


def test_category_left_with_no_samples_says_why(tmp_path: Path) -> None:
    write_rows(tmp_path / "a.jsonl", prompts(["x", "y"]))
    write_rows(tmp_path / "b.jsonl", ["{bad", {"messages": []}, "[1"])
    write_rows(tmp_path / "c.jsonl", [*prompts(["x", "y", "x"]), "{bad"])
    write_rows(tmp_path / "d.jsonl", prompts(["t1", "t2"]))
    categories = [cat(n, f"{n}.jsonl", partition="long") for n in "abc"] + [
        {"name": "d", "source": {"path": "d.jsonl"}}, cat("z", "d.jsonl", partition="long", cap=0)]
    partitions = {"long": {"max_tokens": 8, "min_prompt_tokens": 50}}
    plan = build_plan(make_job(tmp_path, categories, partitions=partitions))
    assert sorted(contents(plan)) == ["x", "y"]
    # b: every row bad; c: all copies of a's prompts; d: too short for every partition;
    # a: planned, and z: asked for none, say nothing.
    assert plan.warnings == [
        "category b: all 3 rows of b.jsonl were rejected (malformed_json 2, empty_prompt 1)",
        "category c: no samples from the 4 rows of c.jsonl: 1 rejected (malformed_json 1), "
        "3 duplicated prompts earlier categories planned",
        "category d: no samples from the 2 rows of d.jsonl: "
        "2 below every partition's min_prompt_tokens",
    ]


def test_tokenizer_that_fails_to_load_is_a_job_error(tmp_path: Path) -> None:
    # A tokenizer the job names must count the tokens, never a silent estimate instead.
    write_rows(tmp_path / "a.jsonl", prompts(["x"]))
    with pytest.raises(JobError, match=r"tokenizer: .*missing\.json"):
        build_plan(make_job(tmp_path, [cat("a", "a.jsonl")], tokenizer="missing.json"))


def test_demo_job_plans_every_category() -> None:
    plan = build_plan(load_job(DEMO))
    names = ["chat", "code", "math", "reasoning", "multilingual", "long_context", "tool_use"]
    assert list(dict.fromkeys(s.category for s in plan.samples)) == names
    for name in names:
        assert sum(st.rows_read for (c, _), st in plan.stats.items() if c == name) >= 30
    assert plan.rejected_by_reason() == {"empty_prompt": 1, "malformed_json": 1}
    assert plan.totals()["duplicates"] == 1
    long_ctx = {s.partition for s in plan.samples if s.category == "long_context"}
    assert long_ctx == {"short", "long"}
    assert any(len(s.messages) > 2 for s in plan.samples if s.category == "reasoning")
    assert all(s.messages[0]["role"] == "system" for s in plan.samples if s.category == "tool_use")


@pytest.mark.parametrize("spp", [1, 2])
def test_sample_ids_unique(tmp_path: Path, spp: int) -> None:
    write_rows(tmp_path / "a.jsonl", prompts([f"q{i}" for i in range(300)]))
    plan = build_plan(make_job(tmp_path, [cat("a", "a.jsonl")], samples_per_prompt=spp))
    assert len({s.id for s in plan.samples}) == 300 * spp

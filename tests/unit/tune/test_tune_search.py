"""The tune's search: successive halving within a budget, on a fake clock and a fake measure;
and the tune directory it resumes from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from draftgen.clock import FakeClock
from draftgen.errors import JobError
from draftgen.servers.tune_section import Levers
from draftgen.tune import Row, TuneResult, format_table
from draftgen.tune.candidates import REFERENCE, Candidate, candidate_for
from draftgen.tune.directory import Status, Trial, TuneDir
from draftgen.tune.result import build_rows
from draftgen.tune.search import SearchOptions, SearchOutcome, search

LAUNCH_S = 30.0


def grid(*limits: int) -> list[Candidate]:
    return [candidate_for(Levers()),
            *(candidate_for(Levers(max_running_requests=n)) for n in limits)]


@dataclass
class FakeMeasure:
    """Each candidate's true tok/s; a trial costs a launch plus its window on the clock."""

    clock: FakeClock
    speed: dict[str, float]
    status: dict[str, Status] = field(default_factory=dict)
    # A status at one rung only: (label, rung) -> status, e.g. an OOM in a longer window.
    status_at: dict[tuple[str, int], Status] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)
    fail_after: int | None = None

    async def __call__(self, cand: Candidate, rung: int, seconds: float) -> Trial:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt  # the tune killed mid-way
        self.calls.append((cand.label, rung))
        status = self.status_at.get((cand.label, rung), self.status.get(cand.label, "measured"))
        if status in ("failed", "refused"):
            self.clock.advance(5.0)
            return Trial(cand.id, rung, cand.levers.changes(), cand.origin, status,
                         reason="engine exited (code 1)" if rung == 0 else
                         "torch.OutOfMemoryError: CUDA out of memory", seconds=seconds,
                         cost_s=5.0)
        self.clock.advance(LAUNCH_S + seconds)
        return Trial(cand.id, rung, cand.levers.changes(), cand.origin, status,
                     seconds=seconds, cost_s=LAUNCH_S + seconds,
                     tok_s=self.speed[cand.label], kv_tokens=1000,
                     probe=None if cand.is_reference else
                     {"passed": status == "measured", "top1_agreement": 0.9})


def objective(trial: Trial, trials: Sequence[Trial]) -> float | None:
    return 1000.0 / trial.tok_s if trial.usable and trial.tok_s else None


async def run(cands: list[Candidate], measure: FakeMeasure, *, budget_s: float = 10_000,
              recorded: Sequence[Trial] = (), sink: list[Trial] | None = None,
              **kw: object) -> SearchOutcome:
    out = sink if sink is not None else []
    opts = SearchOptions(budget_s=budget_s, base_s=10.0, **kw)  # type: ignore[arg-type]
    return await search(cands, measure, recorded=recorded, record=out.append,
                        objective=objective, opts=opts, clock=measure.clock)


def table(out: SearchOutcome) -> tuple[list[Row], str]:
    """The rows and the table the tuner makes of a search."""
    rows = build_rows(out.candidates, out.trials, lambda t: objective(t, out.trials))
    best = next((r for r in rows if out.best is not None and r.candidate == out.best.id), None)
    saving = None
    if out.best_trial is not None and out.reference_trial is not None:
        mine, ref = objective(out.best_trial, []), objective(out.reference_trial, [])
        saving = ref - mine if mine is not None and ref is not None else None
    result = TuneResult(Path("tune"), tuple(rows), rows[0], best, None, None, saving,
                        out.spent_s, 10_000, out.budget_stopped, out.notes)
    return rows, format_table(result)


SPEEDS = {"reference": 100.0, "max_running_requests=4": 150.0,
          "max_running_requests=8": 300.0, "max_running_requests=16": 400.0,
          "max_running_requests=32": 390.0, "max_running_requests=64": 120.0,
          "max_running_requests=128": 80.0}


async def test_halving_measures_the_leaders_longer_and_keeps_the_best() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS)
    out = await run(grid(4, 8, 16, 32, 64, 128), m, eta=2, max_rungs=4, combine=False)
    assert out.best is not None and out.best.label == "max_running_requests=16"
    rungs: dict[int, list[str]] = {}
    for label, rung in m.calls:
        rungs.setdefault(rung, []).append(label)
    # 128 is slower than the reference: never measured again. 5 alive -> 3 -> 2 -> 1.
    assert rungs[1] == ["reference", "max_running_requests=16", "max_running_requests=32",
                        "max_running_requests=8"]
    assert rungs[2] == ["reference", "max_running_requests=16", "max_running_requests=32"]
    assert rungs[3] == ["reference", "max_running_requests=16"]
    # Each rung's window is eta times the last; the reference is paired at every rung.
    assert {t.rung: t.seconds for t in out.trials} == {0: 10.0, 1: 20.0, 2: 40.0, 3: 80.0}
    assert out.best_trial is not None and out.best_trial.rung == 3
    assert out.reference_trial is not None and out.reference_trial.rung == 3
    assert not out.budget_stopped
    assert {t.candidate for t in out.trials} == {c.id for c in out.candidates}


async def test_the_budget_is_respected() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS)
    # Each trial costs 40 s at rung 0: the reference and three candidates fit in 170 s.
    out = await run(grid(4, 8, 16, 32, 64, 128), m, budget_s=170, combine=False)
    assert len(m.calls) == 4 and out.budget_stopped
    assert out.spent_s <= 170
    rows, _ = table(out)
    assert [r.candidate for r in rows if r.status == "not measured"] == [
        c.id for c in grid(32, 64, 128)[1:]]
    assert out.best is not None and out.best.label == "max_running_requests=16"


async def test_the_reference_is_measured_whatever_the_budget() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS)
    out = await run(grid(4, 8), m, budget_s=1)
    assert m.calls == [("reference", 0)] and out.best is None and out.budget_stopped


async def test_a_launch_failure_is_a_result_and_never_promoted() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS, status={"max_running_requests=16": "failed"})
    sink: list[Trial] = []
    out = await run(grid(8, 16), m, sink=sink, combine=False)
    failed = [t for t in sink if t.status == "failed"]
    assert [(t.levers, t.rung, t.reason) for t in failed] == [
        ({"max_running_requests": 16}, 0, "engine exited (code 1)")]
    assert out.best is not None and out.best.label == "max_running_requests=8"
    assert ("max_running_requests=16", 1) not in m.calls


async def test_a_candidate_that_fails_the_probe_is_out_whatever_its_speed() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS, status={"max_running_requests=16": "rejected"})
    out = await run(grid(8, 16), m, combine=False)
    assert out.best is not None and out.best.label == "max_running_requests=8"
    assert [c for c in m.calls if c[1] > 0 and c[0] == "max_running_requests=16"] == []


async def test_nothing_faster_than_the_noise_keeps_the_reference() -> None:
    m = FakeMeasure(FakeClock(), {"reference": 100.0, "max_running_requests=8": 101.0})
    out = await run(grid(8), m)
    assert out.best is None and out.reference_trial is not None


async def test_levers_that_helped_are_combined() -> None:
    cands = [candidate_for(Levers()), candidate_for(Levers(max_running_requests=16)),
             candidate_for(Levers(chunked_prefill=4096)),
             candidate_for(Levers(prefix_cache=False))]
    speeds = {"reference": 100.0, "max_running_requests=16": 200.0,
              "chunked_prefill=4096": 120.0, "prefix_cache=false": 90.0,
              "max_running_requests=16, chunked_prefill=4096": 260.0}
    m = FakeMeasure(FakeClock(), speeds)
    out = await run(cands, m, max_rungs=1)
    assert m.calls[-1] == ("max_running_requests=16, chunked_prefill=4096", 0)
    assert out.best is not None and out.best.origin == "combined"


async def test_of_near_equals_the_fewest_changes_win() -> None:
    # The combined candidate adds a lever that gains nothing beyond the noise (2% faster):
    # the single lever is the answer. Clearly faster (10%), the combination would be.
    cands = [candidate_for(Levers()), candidate_for(Levers(max_running_requests=16)),
             candidate_for(Levers(cpu_kv_gib=2))]
    combined = "max_running_requests=16, cpu_kv_gib=2"
    for gain, winner in ((1.02, "max_running_requests=16"), (1.10, combined)):
        speeds = {"reference": 100.0, "max_running_requests=16": 200.0,
                  "cpu_kv_gib=2": 108.0, combined: 200.0 * gain}
        m = FakeMeasure(FakeClock(), speeds)
        out = await run(cands, m, max_rungs=1)
        assert m.calls[-1] == (combined, 0)
        assert out.best is not None and out.best.label == winner, gain
    # A near-equal that does not itself beat the reference by the margin is no answer.
    two = candidate_for(Levers(max_running_requests=16, cpu_kv_gib=2), "listed")
    speeds = {"reference": 100.0, "max_running_requests=16": 101.5, two.label: 104.2}
    m = FakeMeasure(FakeClock(), speeds)
    out = await run([cands[0], cands[1], two], m, max_rungs=1, combine=False)
    assert out.best is not None and out.best.label == two.label


async def test_a_candidate_the_reference_shows_cannot_pay_is_skipped_not_measured() -> None:
    def skip(cand: Candidate, ref: Trial) -> str | None:
        assert ref.candidate == REFERENCE and ref.rung == 0
        return "not tried: idle" if cand.label == "max_running_requests=32" else None

    m = FakeMeasure(FakeClock(), SPEEDS)
    sink: list[Trial] = []
    out = await search(grid(16, 32), m, recorded=[], record=sink.append, objective=objective,
                       opts=SearchOptions(budget_s=10_000, base_s=10.0, max_rungs=2),
                       clock=m.clock, skip=skip)
    assert ("max_running_requests=32", 0) not in m.calls
    skipped = [t for t in sink if t.status == "skipped"]
    assert [(t.levers, t.reason, t.cost_s) for t in skipped] == [
        ({"max_running_requests": 32}, "not tried: idle", 0.0)]
    assert out.best is not None and out.best.label == "max_running_requests=16"
    # Resumed, the skip stands as recorded: neither measured nor asked again.
    m2 = FakeMeasure(FakeClock(), SPEEDS)
    await search(grid(16, 32), m2, recorded=sink, record=sink.append, objective=objective,
                 opts=SearchOptions(budget_s=10_000, base_s=10.0, max_rungs=2),
                 clock=m2.clock, skip=lambda c, r: None)
    assert m2.calls == []


async def test_a_tune_resumes_without_measuring_again(tmp_path: Path) -> None:
    store = TuneDir(tmp_path / "t")
    header = {"profile_hash": "abc", "job": "def"}
    assert store.open(header) == []
    clock = FakeClock()
    m = FakeMeasure(clock, SPEEDS, fail_after=5)
    with pytest.raises(KeyboardInterrupt):
        await search(grid(4, 8, 16, 32), m, recorded=[], record=store.append,
                     objective=objective, opts=SearchOptions(budget_s=10_000, base_s=10.0),
                     clock=clock)
    recorded = TuneDir(tmp_path / "t").open(header)
    assert [(t.candidate, t.rung) for t in recorded] == [
        (c.id, 0) for c in grid(4, 8, 16, 32)]
    again = FakeMeasure(FakeClock(), SPEEDS)
    out = await search(grid(4, 8, 16, 32), again, recorded=recorded, record=store.append,
                       objective=objective, opts=SearchOptions(budget_s=10_000, base_s=10.0),
                       clock=again.clock)
    assert all(rung > 0 for _, rung in again.calls), again.calls
    assert out.best is not None and out.best.label == "max_running_requests=16"
    # Done: a third run measures nothing, and the budget counts what was spent before.
    third = FakeMeasure(FakeClock(), SPEEDS)
    final = await search(grid(4, 8, 16, 32), third, recorded=TuneDir(tmp_path / "t").open(header),
                         record=store.append, objective=objective,
                         opts=SearchOptions(budget_s=10_000, base_s=10.0), clock=third.clock)
    assert third.calls == [] and final.best == out.best
    assert final.spent_s == pytest.approx(sum(t.cost_s for t in final.trials))


async def test_the_budget_counts_earlier_sessions() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS)
    sink: list[Trial] = []
    await run(grid(4, 8), m, budget_s=10_000, sink=sink, max_rungs=1)
    again = FakeMeasure(FakeClock(), SPEEDS)
    out = await run(grid(4, 8, 16), again, budget_s=sum(t.cost_s for t in sink) + 10,
                    recorded=sink)
    assert again.calls == [] and out.budget_stopped


def test_the_tune_directory_cuts_a_torn_line_and_refuses_another_tune(tmp_path: Path) -> None:
    store = TuneDir(tmp_path)
    header = {"profile_hash": "abc", "job": "def"}
    store.open(header)
    store.append(Trial("reference", 0, {}, "reference", "measured", tok_s=5.0))
    with (tmp_path / "tune.jsonl").open("ab") as f:
        f.write(b'{"candidate": "x", "ru')
    again = TuneDir(tmp_path)
    trials = again.open(header)
    assert [t.candidate for t in trials] == ["reference"] and again.torn_bytes > 0
    assert (tmp_path / "tune.jsonl").read_bytes().endswith(b"}\n")
    with pytest.raises(JobError, match="another job"):
        TuneDir(tmp_path).open({"profile_hash": "abc", "job": "other"})


def test_the_grid_must_start_with_the_reference() -> None:
    import asyncio

    m = FakeMeasure(FakeClock(), SPEEDS)
    with pytest.raises(ValueError, match="reference"):
        asyncio.run(search(grid(4)[1:], m, recorded=[], record=lambda t: None,
                           objective=objective, opts=SearchOptions(budget_s=1), clock=m.clock))
    assert REFERENCE == "reference"


async def test_a_candidate_whose_longest_measurement_failed_is_out() -> None:
    # The leader of the first rung runs out of memory in the longer window of the second:
    # its shorter numbers do not make it the answer. The runner-up, whose longest
    # measurement passed, is.
    oom = {("max_running_requests=16", 1): "failed"}
    m = FakeMeasure(FakeClock(), SPEEDS, status_at=oom)  # type: ignore[arg-type]
    out = await run(grid(8, 16), m, max_rungs=2, combine=False)
    assert ("max_running_requests=16", 1) in m.calls
    assert out.best is not None and out.best.label == "max_running_requests=8"
    assert out.best_trial is not None and out.best_trial.rung == 0
    assert out.reference_trial is not None and out.reference_trial.rung == 0
    rows, text = table(out)
    failed = rows[2]
    assert (failed.status, failed.rung, failed.ratio, failed.predicted_s) == (
        "failed", 1, None, None)
    assert "rung 1" in failed.note and "out of memory" in failed.note
    assert "best: max_running_requests=8" in text
    # Alone, it leaves the reference as the answer, and the table says so.
    m = FakeMeasure(FakeClock(), SPEEDS, status_at=oom)  # type: ignore[arg-type]
    out = await run(grid(16), m, max_rungs=2, combine=False)
    assert out.best is None and out.best_trial is None
    rows, text = table(out)
    assert rows[1].status == "failed" and "best: the reference" in text


async def test_a_later_failure_of_the_reference_keeps_the_comparisons_made() -> None:
    m = FakeMeasure(FakeClock(), SPEEDS,
                    status_at={("reference", 1): "failed"})  # type: ignore[arg-type]
    out = await run(grid(8, 16), m, max_rungs=3, combine=False)
    # Nothing measured beside it could be compared: no candidate is measured at rung 1.
    assert [c for c in m.calls if c[1] > 0] == [("reference", 1)]
    assert out.best is not None and out.best.label == "max_running_requests=16"
    assert out.best_trial is not None and out.best_trial.rung == 0
    assert out.reference_trial is not None and out.reference_trial.rung == 0
    rows, text = table(out)
    ref = rows[0]
    assert (ref.status, ref.rung, ref.ratio) == ("measured", 0, 1.0)
    assert "rung 1" in ref.note
    assert "no result" not in text and "best: max_running_requests=16" in text, text
    assert any("rung 1" in n for n in out.notes)


async def test_a_combination_that_changes_nothing_is_skipped() -> None:
    # The skip applies to the combined candidate too: one the reference shows cannot pay
    # is never measured (and so can never win on noise).
    cands = [candidate_for(Levers()), candidate_for(Levers(max_running_requests=16)),
             candidate_for(Levers(chunked_prefill=4096))]
    combined = "max_running_requests=16, chunked_prefill=4096"
    speeds = {"reference": 100.0, "max_running_requests=16": 200.0,
              "chunked_prefill=4096": 120.0, combined: 260.0}
    m = FakeMeasure(FakeClock(), speeds)
    sink: list[Trial] = []
    out = await search(cands, m, recorded=[], record=sink.append, objective=objective,
                       opts=SearchOptions(budget_s=10_000, base_s=10.0, max_rungs=1),
                       clock=m.clock,
                       skip=lambda c, r: "not tried: same" if c.origin == "combined" else None)
    assert (combined, 0) not in m.calls
    assert [t.status for t in sink if t.origin == "combined"] == ["skipped"]
    assert out.best is not None and out.best.label == "max_running_requests=16"


@pytest.mark.parametrize("change", [
    {"prompts": 24}, {"max_tokens": 64}, {"top_k": 20}, {"confidence": 0.95},
    {"kl_margin": 1e-4}, {"top1_margin": 0.01}, {"detect_kl": 1e-4}, {"cache_read": False}])
def test_a_changed_probe_is_another_tune(tmp_path: Path, change: dict[str, object]) -> None:
    # The trials' verdicts were made by the probe as it was: a stricter or larger one must
    # not reuse them.
    from draftgen.engines.install import EngineInstall
    from draftgen.probe import ProbeThresholds
    from draftgen.servers import load_profile
    from draftgen.tune.tuner import TuneOptions, tune_key

    profile = load_profile(Path(__file__).resolve().parents[3] / "examples" / "profiles"
                           / "kimi-k2.5-sglang-8gpu.yaml")
    install = EngineInstall("sglang", "python", "0.5.23")
    key = tune_key(profile, install, "job", TuneOptions())
    probe = profile.quality.probe.model_copy(update=change)
    other = profile.model_copy(update={"quality": profile.quality.model_copy(
        update={"probe": probe})})
    assert tune_key(other, install, "job", TuneOptions())["probe"] != key["probe"]
    # The prefill path's fixed thresholds too.
    stricter = tune_key(profile, install, "job",
                        TuneOptions(thresholds=ProbeThresholds(min_top1=0.99)))
    assert [k for k in key if key[k] != stricter[k]] == ["probe"]
    TuneDir(tmp_path).open(key)
    with pytest.raises(JobError, match="another probe"):
        TuneDir(tmp_path).open(stricter)

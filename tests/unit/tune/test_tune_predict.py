"""The capacity model as the tune reads it: the job's projected KV demand on a server (what
the "did not bind" skip weighs), and a prediction that runs against its own window, which
the table must explain by the term of the model that turned it."""

from __future__ import annotations

from typing import Any

import pytest

from draftgen.sample import Sample
from draftgen.servers.tune_section import Levers
from draftgen.tune.candidates import REFERENCE, candidate_for
from draftgen.tune.directory import Trial
from draftgen.tune.predict import JobModel
from draftgen.tune.result import build_rows


def samples(n: int, category: str, partition: str, prompt: int, max_tokens: int
            ) -> list[Sample]:
    return [Sample(f"{category}-{i}", category, partition,
                   ({"role": "user", "content": f"{category} {i}"},), max_tokens,
                   prompt_tokens=prompt) for i in range(n)]


def trial(cid: str = REFERENCE, **kw: Any) -> Trial:
    fields: dict[str, Any] = {"tok_s": 100.0, "kv_tokens": 100_000, "max_running": 64,
                              "speed": [[8.0, 80.0], [32.0, 280.0]], **kw}
    levers = {} if cid == REFERENCE else {"max_running_requests": 16}
    return Trial(cid, 0, levers, "reference" if cid == REFERENCE else "grid", "measured",
                 **fields)


def test_the_kv_demand_is_the_capacity_models_steady_state() -> None:
    # 32 in flight; answers measured at 1,000 tokens (uncensored: all of them finished).
    model = JobModel(samples(64, "chat", "short", 200, 4000), {"short": 32})
    ref = trial(lengths={"chat/short": [1000] * 10})
    demand = model.kv_demand(ref)
    assert demand is not None
    assert demand.running == 32 and demand.concurrency == 32
    # A request holds its prompt and half its answer on average.
    assert demand.footprint == pytest.approx(200 + 500, abs=1)
    assert demand.tokens == pytest.approx(32 * 700, rel=0.01)
    # The running limit caps what the job can hold on this server.
    model = JobModel(samples(64, "chat", "short", 200, 4000), {"short": 32})
    capped = model.kv_demand(trial(max_running=8, lengths={"chat/short": [1000] * 10}))
    assert capped is not None and capped.running == 8


def test_a_window_that_saw_only_the_short_answers_does_not_set_the_demand() -> None:
    # Kimi's case: reasoning answers run for many minutes; a 20 s window finished two short
    # ones and left 30 running. Those two are no measure of the group: the model's prior
    # (half of max_tokens) is, until a run's lengths (--lengths-from) say otherwise.
    work = samples(64, "reasoning", "long", 500, 16_000)
    censored = trial(lengths={"reasoning/long": [120, 200]}, unfinished={"reasoning/long": 30})
    demand = JobModel(work, {"long": 32}).kv_demand(censored)
    assert demand is not None and demand.footprint == pytest.approx(500 + 4000, abs=1)
    assert demand.tokens > censored.kv_tokens  # type: ignore[operator]
    known = JobModel(work, {"long": 32}, known_lengths={("reasoning", "long"): [300] * 20})
    told = known.kv_demand(censored)
    assert told is not None and told.footprint < 1000
    # Mostly finished: the window's lengths stand.
    finished = trial(lengths={"reasoning/long": [120, 200] * 10},
                     unfinished={"reasoning/long": 3})
    seen = JobModel(work, {"long": 32}).kv_demand(finished)
    assert seen is not None and seen.footprint < 1000


def test_a_prediction_against_its_window_is_explained_by_the_term_that_turned_it() -> None:
    # The candidate decodes faster at every batch its window saw, but its cache holds few of
    # the job's requests (answers of 2,000 tokens on 200-token prompts: 1,200 tokens each on
    # average; 8,000 KV tokens hold 6 of them): over the whole job it is slower.
    model = JobModel(samples(200, "chat", "short", 200, 4000), {"short": 32})
    lengths = {"chat/short": [2000] * 20}
    ref = trial(lengths=lengths, tok_s=100.0)
    cand_id = candidate_for(Levers(max_running_requests=16)).id
    small = trial(cand_id, lengths=lengths, tok_s=130.0, kv_tokens=8_000,
                  speed=[[8.0, 110.0], [32.0, 380.0]],
                  probe={"passed": True, "mean_kl": 0.0, "top1_agreement": 1.0})
    trials = [ref, small]
    cands = [candidate_for(Levers()), candidate_for(Levers(max_running_requests=16))]

    def value(t: Trial) -> float | None:
        return model.seconds(t, trials)

    rows = build_rows(cands, trials, value, lambda c, r: model.explain(c, r, trials))
    row = rows[1]
    assert row.ratio is not None and row.ratio > 1 and row.tok_s == 130.0
    # The table says which term turned it: the KV cache, by the job's footprint.
    assert row.why.startswith("measured faster than the reference in its window "
                              "(130.0 vs 100.0 tok/s) but predicted "), row.why
    assert "KV cache (8,000 tokens) holds 6" in row.why and "1,200 tokens" in row.why, row.why
    assert "see the notes" in row.note
    assert rows[0].why == ""
    # Windows and predictions that agree need no word.
    fast = trial(cand_id, lengths=lengths, tok_s=130.0, speed=[[8.0, 110.0], [32.0, 380.0]],
                 probe={"passed": True})
    fresh = JobModel(samples(200, "chat", "short", 200, 4000), {"short": 32})
    assert fresh.explain(fast, ref, [ref, fast]) is None


def test_an_unexplained_contradiction_is_called_a_bug() -> None:
    # Same server, same speed curve: a window that measured it faster yet a prediction of
    # longer has no term of the model behind it.
    model = JobModel(samples(50, "chat", "short", 200, 400), {"short": 8})
    lengths = {"chat/short": [100] * 10}
    ref = trial(lengths=lengths, tok_s=100.0, speed=[[8.0, 100.0]])
    same = trial(candidate_for(Levers(max_running_requests=16)).id, lengths=lengths,
                 tok_s=120.0, speed=[[8.0, 100.0]])
    original = model.seconds

    def skewed(t: Trial, trials: Any, **kw: Any) -> float | None:
        value = original(t, trials, **kw)
        return value * 1.5 if value is not None and t.candidate != REFERENCE else value

    model.seconds = skewed  # type: ignore[method-assign]
    why = model.explain(same, ref, [ref, same])
    assert why is not None and "not explained by the capacity model" in why, why

"""The capacity model on synthetic inputs: exact small cases, regimes, monotonicity, tails."""

from __future__ import annotations

import random

import pytest

from draftgen.planning.capacity import Prediction, predict, steady_state
from draftgen.planning.workload import DecodeSpeed, ServerCapacity, Workload

FLAT = DecodeSpeed(((1, 100.0), (1000, 100_000.0)))  # 10 ms a step at any batch


def uniform(n: int, prompt: int, output: int, *, cap: int = 4, partition: str = "short",
            category: str = "A") -> Workload:
    return Workload((category,) * n, (partition,) * n, (prompt,) * n, (output,) * n,
                    {partition: cap}, {(category, partition): (output,)})


def long_tailed(n: int, seed: int = 1, cap: int = 64) -> Workload:
    rng = random.Random(seed)
    cats = tuple(rng.choice("AB") for _ in range(n))
    parts = tuple("long" if c == "B" else "short" for c in cats)
    prompts = tuple(rng.randint(50, 800) for _ in range(n))
    maxes = tuple(4096 if p == "long" else 2048 for p in parts)
    outs = {("A", "short"): tuple(int(rng.lognormvariate(5.5, 0.9)) for _ in range(500)),
            ("B", "long"): tuple(int(rng.lognormvariate(6.5, 0.7)) for _ in range(500))}
    return Workload(cats, parts, prompts, maxes, {"short": cap, "long": cap // 4}, outs)


def test_speed_interpolates_step_time_and_extrapolates_the_last_segment() -> None:
    s = DecodeSpeed(((10, 500.0), (1, 100.0)))  # step 10 ms at 1, 20 ms at 10
    assert s.points[0] == (1, 100.0)
    assert s.step_s(0.5) == pytest.approx(0.01)
    assert s.step_s(5.5) == pytest.approx(0.015)
    assert s.tok_s(5.5) == pytest.approx(5.5 / 0.015)
    assert s.step_s(19) == pytest.approx(0.03)
    assert s.tok_s(0) == 0.0


def test_speed_never_gets_faster_per_step_beyond_the_last_point() -> None:
    s = DecodeSpeed(((1, 100.0), (10, 2000.0)))  # step time falls: a noisy measurement
    assert s.step_s(50) == pytest.approx(s.step_s(10))


def test_one_point_and_the_assumed_shape_saturate() -> None:
    one = DecodeSpeed(((8, 800.0),))
    assert one.tok_s(8) == pytest.approx(800)
    assert one.tok_s(64) > one.tok_s(8)
    assumed = DecodeSpeed.assumed(single_stream_tok_s=50)
    assert assumed.source == "assumed"
    assert assumed.tok_s(1) == pytest.approx(50)
    assert assumed.tok_s(10_000) < 50 * 64 * 2  # saturates near half-batch x single speed


def test_bad_speed_points_are_refused() -> None:
    with pytest.raises(ValueError):
        DecodeSpeed(())
    with pytest.raises(ValueError):
        DecodeSpeed(((0, 10.0),))


def test_concurrency_bound_run_is_exact() -> None:
    # 400 samples of 100 tokens, 4 at a time, 10 ms a step: 100 rounds of 100 steps = 100 s.
    p = predict(ServerCapacity(10**6, FLAT), uniform(400, 10, 100))
    assert p.duration_s == pytest.approx(100.0)
    assert p.output_tokens == 40_000
    assert p.tok_s == pytest.approx(400.0)
    assert p.mean_running == pytest.approx(4.0)
    assert p.tokens_per_step == pytest.approx(4.0)
    assert p.preemptions == 0
    assert p.steady.bound == "concurrency"
    assert p.steady.running == 4


def test_prefill_is_charged_on_admission() -> None:
    speed = DecodeSpeed(FLAT.points, prefill_tok_s=1000.0)
    # Each round admits 4 prompts of 100 tokens: 0.4 s of prefill on top of 1 s of decode.
    p = predict(ServerCapacity(10**6, speed), uniform(400, 100, 100))
    assert p.duration_s == pytest.approx(140.0)


def test_servers_share_the_work_and_the_concurrency() -> None:
    w = uniform(400, 10, 100, cap=8)
    one = predict(ServerCapacity(10**6, FLAT), w)
    two = predict(ServerCapacity(10**6, FLAT, servers=2), w)
    assert one.duration_s == pytest.approx(50.0)
    assert two.duration_s == pytest.approx(50.0)  # 4 per server: the cap binds, not servers
    wide = predict(ServerCapacity(10**6, FLAT, servers=2), uniform(400, 10, 100, cap=16))
    assert wide.duration_s == pytest.approx(25.0)
    assert wide.mean_running == pytest.approx(8.0)


def test_kv_bound_regime_runs_about_capacity_over_footprint() -> None:
    # prompt 100 + output 100: a running request holds 150 tokens on average; 1,500 fit 10.
    w = uniform(300, 100, 100, cap=1000)
    p = predict(ServerCapacity(1500, FLAT), w)
    assert p.steady.bound == "kv"
    assert p.steady.footprint_tokens == pytest.approx(150.0)
    assert p.steady.kv_running == pytest.approx(10.0)
    assert 8 <= p.mean_running <= 13
    assert p.preemptions > 0  # admission by prompt only over-fills, as vLLM does
    assert p.mean_waiting > 100  # everything else queues at the server


def test_paged_cache_loses_half_a_block_per_request() -> None:
    w = uniform(300, 100, 100, cap=1000)
    paged = predict(ServerCapacity(1500, FLAT, block_size=101), w)
    assert paged.steady.footprint_tokens == pytest.approx(200.0)
    assert paged.duration_s > predict(ServerCapacity(1500, FLAT), w).duration_s


def test_engine_max_running_is_a_bound() -> None:
    p = predict(ServerCapacity(10**6, FLAT, max_running=2), uniform(40, 10, 100, cap=8))
    assert p.steady.bound == "max_running"
    assert p.mean_running == pytest.approx(2.0)
    assert p.duration_s == pytest.approx(20.0)


def test_more_capacity_speed_or_servers_never_slows_a_kv_bound_run() -> None:
    w = long_tailed(3000, cap=1024)
    speed = DecodeSpeed(((1, 50.0), (16, 600.0), (64, 1800.0), (256, 3000.0)))
    durations = [predict(ServerCapacity(kv, speed, block_size=16), w).duration_s
                 for kv in (20_000, 50_000, 100_000, 400_000)]
    assert durations == sorted(durations, reverse=True)
    assert durations[0] > 1.5 * durations[-1]
    base = predict(ServerCapacity(50_000, speed), w)
    faster = DecodeSpeed(tuple((b, 2 * r) for b, r in speed.points))
    assert predict(ServerCapacity(50_000, faster), w).duration_s == pytest.approx(
        base.duration_s / 2, rel=1e-6)
    assert predict(ServerCapacity(50_000, speed, servers=2), w).duration_s < base.duration_s


def test_more_samples_take_longer() -> None:
    w = long_tailed(2000)
    srv = ServerCapacity(50_000, DecodeSpeed(((1, 50.0), (64, 1800.0))))
    half = predict(srv, w.take({"A": 500, "B": 500}))
    full = predict(srv, w)
    assert half.samples < full.samples
    assert half.duration_s < full.duration_s


def test_long_tail_at_the_end_is_seen_by_the_simulation_not_the_average() -> None:
    # 400 short answers and 2 very long ones: the run ends decoding the long two alone.
    n_short = 400
    cats = ("s",) * n_short + ("l",) * 2
    w = Workload(cats, ("p",) * (n_short + 2), (10,) * (n_short + 2),
                 (20,) * n_short + (5000,) * 2, {"p": 50},
                 {("s", "p"): (20,), ("l", "p"): (5000,)})
    p = predict(ServerCapacity(10**6, FLAT), w)
    average = p.output_tokens / p.steady.tok_s  # what a steady-state division would say
    assert p.duration_s > 10 * average
    # The long two come last in the plan: 8 rounds of 20 steps, then 5,000 steps of 10 ms.
    assert p.duration_s == pytest.approx(1.6 + 50.0)
    assert p.tail_s > 0.9 * p.duration_s
    assert p.mean_running < 4  # (1.6 s × 50 + 50 s × 2) / 51.6 s


def test_steady_footprint_is_weighted_by_how_long_requests_live() -> None:
    w = Workload(("A",) * 10, ("p",) * 10, (0,) * 10, (1000,) * 10, {"p": 10})
    outputs = [10] * 9 + [1000]
    st = steady_state(ServerCapacity(10_000, FLAT), w, outputs)
    assert st.footprint_tokens == pytest.approx((9 * 10 * 5 + 1000 * 500) / 1090)
    assert st.footprint_tokens > 8 * (sum(outputs) / len(outputs) / 2)


def test_partitions_get_their_own_eta() -> None:
    n = 200
    w = Workload(("A",) * n + ("B",) * n, ("short",) * n + ("long",) * n, (10,) * (2 * n),
                 (100,) * (2 * n), {"short": 20, "long": 2},
                 {("A", "short"): (100,), ("B", "long"): (100,)})
    p = predict(ServerCapacity(10**6, FLAT), w)
    assert p.eta_s("short") == pytest.approx(10.0)  # 10 rounds of 100 steps
    assert p.eta_s("long") == pytest.approx(100.0)
    assert p.eta_s() == p.duration_s == pytest.approx(100.0)
    assert {c.name: c.samples for c in p.categories} == {"A": n, "B": n}


def test_output_draws_are_seeded_capped_and_stable_under_caps() -> None:
    w = Workload(("A",) * 50 + ("B",) * 50, ("p",) * 100, (5,) * 100, (30,) * 100, {"p": 4},
                 {("A", "p"): tuple(range(1, 100)), ("B", "p"): (7,)})
    a = w.draw_outputs(3)
    assert a == w.draw_outputs(3)
    assert a != w.draw_outputs(4)
    assert max(a) <= 30
    assert a[50:] == [7] * 50
    kept = w.take({"A": 10})
    assert len(kept) == 60
    assert kept.draw_outputs(3) == a[:10] + a[50:]


def test_output_falls_back_from_group_to_category_partition_and_prior() -> None:
    w = Workload(("A", "A", "C", "D"), ("p", "q", "p", "r"), (1, 1, 1, 1), (100, 100, 100, 80),
                 {"p": 1, "q": 1, "r": 1}, {("A", "p"): (10,), ("B", "p"): (20,)})
    draws = w.draw_outputs(0)
    assert draws[0] == 10  # its own group
    assert draws[1] == 10  # same category, other partition
    assert draws[2] in (10, 20)  # same partition, other categories
    assert draws[3] in (10, 20)  # anything measured
    prior = Workload(("A",), ("p",), (1,), (80,), {"p": 1})
    assert prior.draw_outputs(0) == [40]


def test_prompts_larger_than_the_cache_are_left_out_and_outputs_clipped() -> None:
    w = Workload(("A",) * 3, ("p",) * 3, (50, 2000, 10), (5000,) * 3, {"p": 3},
                 {("A", "p"): (5000,)})
    p = predict(ServerCapacity(1000, FLAT), w)
    assert p.unservable == 1
    assert p.samples == 2
    assert p.output_tokens == (1000 - 1 - 50) + (1000 - 1 - 10)
    assert any("larger than the KV cache" in n for n in p.notes)


def test_empty_workload_predicts_nothing_to_do() -> None:
    w = Workload((), (), (), (), {"p": 1})
    p = predict(ServerCapacity(1000, FLAT), w)
    assert isinstance(p, Prediction)
    assert p.duration_s == 0.0
    assert p.output_tokens == 0


def test_workload_columns_and_partitions_are_checked() -> None:
    with pytest.raises(ValueError, match="one entry per sample"):
        Workload(("A",), (), (1,), (1,), {"p": 1})
    with pytest.raises(ValueError, match="no concurrency"):
        Workload(("A",), ("p",), (1,), (1,), {})


def test_workload_from_plan_rows() -> None:
    rows = [{"category": "A", "partition": "p", "prompt_tokens": 12, "max_tokens": 64},
            {"category": "B", "partition": "p", "max_tokens": 64}]
    w = Workload.from_plan_rows(rows, {"p": 2}, {("A", "p"): [3, 4]})
    assert w.prompt_tokens == (12, 0)
    assert w.output_samples == {("A", "p"): (3, 4)}


def test_known_outputs_replace_the_draws_and_follow_caps() -> None:
    w = Workload(("A", "A", "B"), ("p",) * 3, (1, 1, 1), (50, 50, 50), {"p": 1},
                 {("A", "p"): (5,)}, known_outputs=(7, 80, 9))
    assert w.draw_outputs(0) == [7, 50, 9]
    assert w.take({"A": 1}).draw_outputs(0) == [7, 9]
    with pytest.raises(ValueError, match="known_outputs"):
        Workload(("A",), ("p",), (1,), (1,), {"p": 1}, known_outputs=(1, 2))

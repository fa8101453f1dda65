"""The ETA for answers that end on their own: on made-up states where the answer is known,
and replayed over a recorded run of the demo on the real model (205 samples, 193 s), where
it stays within 30% of the time that was really left from a tenth of the run on, or 2 s at
its very end (the ETA before it: up to 89% short)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from draftgen.running.eta import PartitionWork, Stream, time_left
from draftgen.schedule.lengths import Lengths
from helpers.eta_trace import replay

TRACE = Path(__file__).parent / "data" / "demo-smollm2-trace.json"


def lengths(*values: int) -> Lengths:
    out = Lengths()
    for v in values:
        out.add("c", v)
    return out


def test_nothing_left_is_zero_and_nothing_written_yet_is_unknown() -> None:
    assert time_left([PartitionWork(100, Counter(), [])], Lengths(), 5.0) == 0.0
    waiting = PartitionWork(100, Counter(c=3), [Stream("c", 0, 0)])
    assert time_left([waiting], Lengths(), 5.0) is None
    assert time_left([PartitionWork(100, Counter(), [Stream("c", 5, 5)])], Lengths(),
                     0.0) is None


def test_the_last_answer_takes_what_it_has_left_at_the_engines_rate() -> None:
    # Every answer seen ran 200 tokens; the last one has written 101, the engine 10 tok/s.
    last = PartitionWork(1000, Counter(), [Stream("c", 101, 101)])
    assert time_left([last], lengths(*[200] * 16), 10.0) == pytest.approx(99 / 10)


def test_a_partition_with_few_streams_outlasts_a_busy_one() -> None:
    known = lengths(*[100] * 16)
    # 9 answers share 9 tok/s: 1 token/s each. One partition has 40 queued over 8 streams,
    # the other 8 over 1: the run ends with the second, though it holds a sixth of the work.
    busy = PartitionWork(100, Counter(c=40), [Stream("c", 11, 11)] * 8)
    slow = PartitionWork(100, Counter(c=8), [Stream("c", 11, 11)])
    # 8 queued at 100 and 89 left of the running one, on one stream.
    assert time_left([busy, slow], known, 9.0) == pytest.approx(8 * 100 + 89)
    assert time_left([busy], known, 8.0) == pytest.approx((40 * 100 + 8 * 89) / 8)


def test_the_first_short_answers_do_not_promise_an_early_end() -> None:
    # 16 answers ended at 50 tokens while 16 others run on past 300: with those counted as
    # censored, a queued answer is expected at (far) more than 50.
    ls = lengths(*[50] * 16)
    running = [Stream("c", 300, 300)] * 16
    ls.running({"c": [300] * 16})
    left = time_left([PartitionWork(1000, Counter(c=64), running)], ls, 16.0)
    assert left is not None and left > 64 * 50 / 16 * 2


def test_replayed_over_a_recorded_run_the_eta_is_within_30_percent_of_the_truth(
        capsys: pytest.CaptureFixture[str]) -> None:
    trace = json.loads(TRACE.read_text())
    rows = replay(trace, points=40)
    end = rows[-1][0] + rows[-1][1]
    misses = []
    with capsys.disabled():
        print(f"\nETA replay over {TRACE.name} ({len(trace['samples'])} samples, {end:.0f}s)")
        for t, left, eta in rows:
            miss = None if eta is None else eta / left - 1
            print(f"  t {t:6.1f}s  left {left:6.1f}s  ETA "
                  f"{'-' if eta is None else f'{eta:6.1f}s'}  "
                  f"{'' if miss is None else f'{miss:+.0%}'}")
            if t >= end / 10 and (eta is None or abs(eta - left) > max(0.30 * left, 2.0)):
                misses.append((round(t), round(left), eta and round(eta)))
    assert not misses

"""Expected lengths from the survival curve: what an answer has left, with the answers
still running counted as censored, and the tail a final wave runs to."""

from __future__ import annotations

import pytest

from draftgen.schedule.lengths import MIN_SAMPLES, Lengths


def learned(lengths: list[int], running: list[int] | None = None) -> Lengths:
    out = Lengths()
    for n in lengths:
        out.add("c", n)
    out.running({"c": running or []})
    return out


def test_the_mean_and_what_is_left_follow_the_finished_lengths() -> None:
    ls = learned([100] * 8 + [300] * 8)  # half end at 100, half at 300
    assert ls.expected_left("c", 1000) == pytest.approx(200.0)
    # Past 100, only the 300s are left: 300 - 150.
    assert ls.expected_left("c", 1000, 150) == pytest.approx(150.0)
    # Before 100, both: the mean minus what is written.
    assert ls.expected_left("c", 1000, 50) == pytest.approx(150.0)
    # Longer than every answer seen: it runs on to max_tokens.
    assert ls.expected_left("c", 1000, 400) == pytest.approx(600.0)
    assert ls.expected_left("c", 1000, 1000) == 0.0


def test_running_answers_lengthen_the_mean_the_first_short_ones_would_give() -> None:
    short_first = [50] * MIN_SAMPLES
    alone = learned(short_first)
    censored = learned(short_first, running=[400] * 16)  # half are still running at 400
    assert alone.expected_left("c", 1000) == pytest.approx(50.0)
    # The survival curve stays at 1/2 past 50 and those are expected to run to max_tokens.
    assert censored.expected_left("c", 1000) == pytest.approx(50 + 0.5 * 950)


def test_the_tail_is_the_length_a_share_of_answers_stays_within() -> None:
    ls = learned([*range(10, 170, 10), 1000])  # 16 spread answers and one long
    assert ls.tail("c", 2000, 0.5) == 90.0
    assert ls.tail("c", 2000, 0.99) == 1000.0
    assert ls.tail("c", 500, 0.99) == 500.0  # never past max_tokens


def test_the_prior_stands_in_until_enough_have_finished() -> None:
    ls = Lengths()
    ls.add("c", 10)  # one is not enough
    assert ls.expected_left("c", 1000) == 500.0  # half of max_tokens
    assert ls.tail("c", 1000, 0.9) == 1000.0
    ls.learn_prior("c", done=4, output_tokens=800)  # earlier runs: 200 on average
    assert ls.expected_left("c", 1000, 50) == 150.0
    assert ls.expected_left("c", 1000, 250) == 750.0  # past the prior: runs to the end

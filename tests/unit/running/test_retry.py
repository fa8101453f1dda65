"""Backoff and retries on a fake clock: nothing here really sleeps."""

from __future__ import annotations

import asyncio
import random

import pytest

from draftgen.clock import REAL_CLOCK, FakeClock
from draftgen.errors import BadRequest, ContextTooLong, RequestError, ServerDown, Transient
from draftgen.running.retry import Backoff, RetriesExhausted, with_retries


class Flaky:
    """Fails with the given errors, in order, then returns "ok"."""

    def __init__(self, *errors: RequestError) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


# --- Backoff.delay_s -------------------------------------------------------------------


def test_delays_stay_under_the_exponential_cap() -> None:
    policy = Backoff(base_s=1.0, max_s=60.0)
    rng = random.Random(1)
    for attempt, cap in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (50, 60.0)]:
        delays = [policy.delay_s(attempt, rng) for _ in range(2000)]
        assert all(0.0 <= d <= cap for d in delays), attempt
        # Full jitter: the whole range is used, not just the top of it.
        assert min(delays) < 0.05 * cap and max(delays) > 0.95 * cap, attempt


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert 0.0 <= Backoff(max_s=5.0).delay_s(10_000, random.Random(0)) <= 5.0


def test_delays_are_reproducible_with_a_seeded_rng() -> None:
    policy = Backoff()
    a = [policy.delay_s(n, random.Random(7)) for n in range(1, 6)]
    b = [policy.delay_s(n, random.Random(7)) for n in range(1, 6)]
    assert a == b


@pytest.mark.parametrize("kwargs", [{"base_s": -1.0}, {"max_s": -1.0}, {"max_attempts": 0}])
def test_invalid_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)  # type: ignore[arg-type]


# --- with_retries ----------------------------------------------------------------------


async def test_success_first_time_uses_one_attempt_and_no_sleep() -> None:
    clock = FakeClock()
    result, attempts = await with_retries(Flaky(), Backoff(), clock=clock)
    assert (result, attempts) == ("ok", 1)
    assert clock.sleeps == []


async def test_retries_transient_errors_until_success() -> None:
    clock = FakeClock(start=100.0)
    fn = Flaky(Transient("a"), ServerDown("b"), Transient("c"))
    retries: list[tuple[int, str, float]] = []
    result, attempts = await with_retries(
        fn,
        Backoff(base_s=1.0, max_s=60.0, max_attempts=6),
        clock=clock,
        rng=random.Random(3),
        on_retry=lambda n, err, delay: retries.append((n, str(err), delay)),
    )
    assert (result, attempts, fn.calls) == ("ok", 4, 4)
    assert [(n, msg) for n, msg, _ in retries] == [(1, "a"), (2, "b"), (3, "c")]
    # Each wait is the one announced to on_retry, within that attempt's cap.
    assert clock.sleeps == [delay for _, _, delay in retries]
    assert all(d <= 2.0 ** (n - 1) for n, _, d in retries)
    assert clock.monotonic() == pytest.approx(100.0 + sum(clock.sleeps))


@pytest.mark.parametrize("err", [BadRequest("nope", status=400), ContextTooLong("too long")])
async def test_permanent_errors_are_not_retried(err: RequestError) -> None:
    clock = FakeClock()
    fn = Flaky(err)
    with pytest.raises(type(err)) as info:
        await with_retries(fn, Backoff(), clock=clock)
    assert info.value is err
    assert fn.calls == 1
    assert clock.sleeps == []


async def test_gives_up_after_max_attempts() -> None:
    clock = FakeClock()
    last = Transient("still broken", status=503)
    fn = Flaky(Transient("1"), Transient("2"), last, Transient("never raised"))
    with pytest.raises(RetriesExhausted) as info:
        await with_retries(fn, Backoff(base_s=0.5, max_s=1.0, max_attempts=3), clock=clock)
    exhausted = info.value
    assert fn.calls == 3
    assert len(clock.sleeps) == 2  # no wait after the last attempt
    assert all(0.0 <= d <= 1.0 for d in clock.sleeps)
    assert exhausted.reason == "exhausted_retries"
    assert exhausted.retryable is False
    assert exhausted.attempts == 3
    assert exhausted.last_error is last and exhausted.__cause__ is last
    assert exhausted.status == 503
    assert "3 attempts" in str(exhausted) and "still broken" in str(exhausted)


async def test_one_attempt_policy_never_waits() -> None:
    clock = FakeClock()
    with pytest.raises(RetriesExhausted):
        await with_retries(Flaky(Transient("x")), Backoff(max_attempts=1), clock=clock)
    assert clock.sleeps == []


async def test_other_exceptions_propagate_untouched() -> None:
    async def broken() -> str:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await with_retries(broken, Backoff(), clock=FakeClock())


# --- clocks ----------------------------------------------------------------------------


async def test_fake_clock_sleep_advances_time_and_yields() -> None:
    clock = FakeClock(start=5.0)
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    task = asyncio.create_task(other())
    await clock.sleep(2.5)
    order.append("after sleep")
    await task
    assert order == ["other", "after sleep"]
    assert clock.monotonic() == clock.time() == 7.5


def test_fake_clock_does_not_go_back() -> None:
    with pytest.raises(ValueError):
        FakeClock().advance(-1.0)


async def test_real_clock_reads_real_time() -> None:
    before = REAL_CLOCK.monotonic()
    await REAL_CLOCK.sleep(0)
    assert REAL_CLOCK.monotonic() >= before
    assert REAL_CLOCK.time() > 1.6e9

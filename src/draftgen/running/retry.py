"""Retries with jittered exponential backoff: the only place draftgen waits and tries again.

Which errors are worth another try is decided where they are raised (`RequestError.retryable`,
see `client/classify.py`); this module only decides how long to wait and when to give up.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from draftgen.clock import Clock
from draftgen.errors import Permanent, RequestError

T = TypeVar("T")

# 2**62 s is already far past any cap; it keeps the float product finite for any attempt.
_MAX_EXPONENT = 62


class RetriesExhausted(Permanent):
    """Every allowed attempt failed with a retryable error; `last_error` is the last one."""

    reason = "exhausted_retries"

    def __init__(self, last_error: RequestError, attempts: int) -> None:
        super().__init__(
            f"gave up after {attempts} attempts; last: {last_error.reason}: {last_error}",
            status=last_error.status,
        )
        self.last_error = last_error
        self.attempts = attempts


@dataclass(frozen=True)
class Backoff:
    base_s: float = 1.0
    max_s: float = 60.0
    max_attempts: int = 6

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.max_s < 0:
            raise ValueError(
                f"backoff delays must be >= 0 (base_s={self.base_s}, max_s={self.max_s})"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """Wait after failed attempt number `attempt` (1-based).

        Full jitter (uniform from zero to the exponential cap) rather than a fixed
        exponential: when a server drops, hundreds of requests fail at once, and
        full jitter spreads their return instead of sending them back together.
        """
        exponent = min(max(attempt - 1, 0), _MAX_EXPONENT)
        cap = min(self.max_s, self.base_s * 2.0**exponent)
        return rng.uniform(0.0, cap)


async def with_retries(
    fn: Callable[[], Awaitable[T]],
    policy: Backoff,
    *,
    clock: Clock,
    rng: random.Random | None = None,
    on_retry: Callable[[int, RequestError, float], None] | None = None,
) -> tuple[T, int]:
    """Call `fn` until it succeeds; return its result and the number of attempts used.

    A non-retryable `RequestError` propagates at once; when `policy.max_attempts`
    attempts have all failed, `RetriesExhausted` is raised from the last error.
    `on_retry(attempt, error, delay_s)` runs before each wait. Exceptions that are
    not `RequestError`s are bugs, not request failures, and propagate untouched.
    """
    rng = rng if rng is not None else random.Random()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn(), attempt
        except RequestError as err:
            if not err.retryable:
                raise
            if attempt >= policy.max_attempts:
                raise RetriesExhausted(err, attempt) from err
            delay = policy.delay_s(attempt, rng)
            if on_retry is not None:
                on_retry(attempt, err, delay)
            await clock.sleep(delay)

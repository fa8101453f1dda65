"""How long answers run: output lengths learned online, and what a running request will hold.

The scheduler needs more than a mean. A request that has written 300 tokens of an answer
whose length is unknown will, on average, hold more KV later, or none if it is about to end;
which of the two depends on the shape of the length distribution (a long tail, or answers
that all end near the same length). `Lengths` keeps the recent finished lengths per category
in sorted order and answers "what is the chance an answer that has reached `g` tokens is
still running at `g + h`", the survival ratio S(g + h) / S(g). Until enough answers have
finished, a cautious prior stands in: every answer runs to the mean that earlier runs
recorded, or else to max_tokens; an answer longer than every one seen is expected to run
on to max_tokens.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from dataclasses import dataclass, field

KEEP = 4096  # recent lengths kept per category: the distribution may drift during a run
MIN_SAMPLES = 16  # finished answers before the empirical distribution replaces the prior


@dataclass(slots=True)
class _Sorted:
    order: deque[int] = field(default_factory=deque)
    xs: list[int] = field(default_factory=list)
    total: int = 0

    def add(self, x: int) -> None:
        self.order.append(x)
        insort(self.xs, x)
        self.total += x
        if len(self.order) > KEEP:
            old = self.order.popleft()
            del self.xs[bisect_right(self.xs, old) - 1]
            self.total -= old

    def over(self, x: float) -> int:
        """How many kept lengths exceed x."""
        return len(self.xs) - bisect_right(self.xs, x)


@dataclass(slots=True)
class _Prior:
    n: int = 0
    total: float = 0.0


class Lengths:
    """Output lengths per category: mean for planning, survival for projecting KV use."""

    def __init__(self) -> None:
        self._by_cat: dict[str, _Sorted] = {}
        self._all = _Sorted()
        self._prior: dict[str, _Prior] = {}

    def learn_prior(self, category: str, done: int, output_tokens: int) -> None:
        """Output lengths recorded by earlier runs (a count and a total) seed the mean."""
        if done:
            p = self._prior.setdefault(category, _Prior())
            p.n += done
            p.total += output_tokens

    def add(self, category: str, output_tokens: int) -> None:
        self._by_cat.setdefault(category, _Sorted()).add(output_tokens)
        self._all.add(output_tokens)

    @property
    def learned(self) -> bool:
        """Whether enough answers have finished for the distribution to replace the prior."""
        return len(self._all.xs) >= MIN_SAMPLES

    def _learned(self, category: str) -> _Sorted | None:
        own = self._by_cat.get(category)
        if own is not None and len(own.xs) >= MIN_SAMPLES:
            return own
        return self._all if len(self._all.xs) >= MIN_SAMPLES else None

    def mean(self, category: str, max_tokens: int) -> float:
        learned = self._learned(category)
        if learned is not None:
            mean = learned.total / len(learned.xs)
        elif (p := self._prior.get(category)) is not None:
            mean = p.total / p.n
        else:
            mean = max_tokens / 2
        return min(mean, float(max_tokens))

    def quantile(self, category: str, max_tokens: int, q: float) -> float:
        """The length that a share `q` of answers stay within; max_tokens until learned."""
        learned = self._learned(category)
        if learned is None:
            return float(max_tokens)
        return float(min(max_tokens, learned.xs[min(len(learned.xs) - 1,
                                                     int(q * len(learned.xs)))]))

    def still_running(self, category: str, max_tokens: int, written: int,
                      ahead: list[float]) -> list[float]:
        """For each h in `ahead`, the chance an answer that has written `written` tokens
        has not ended `h` tokens later (0 once max_tokens is reached)."""
        learned = self._learned(category)
        left = max_tokens - written
        if learned is None:
            prior = self._prior.get(category)
            ends = min(max_tokens, prior.total / prior.n) if prior is not None else max_tokens
            if written < ends:
                return [1.0 if h < ends - written else 0.0 for h in ahead]
            return [1.0 if h < left else 0.0 for h in ahead]
        alive = learned.over(written)
        if alive == 0:
            # Longer than every answer seen: assume it runs on to max_tokens.
            return [1.0 if h < left else 0.0 for h in ahead]
        return [learned.over(written + h) / alive if h < left else 0.0 for h in ahead]

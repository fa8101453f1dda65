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

The answers still being written count too: one that has reached `g` tokens says its
length is more than `g` (right-censored), and S is the Kaplan-Meier product over the
finished and the running ones. Without them, the first answers to finish are the shortest,
and a run that learned only from those would expect every answer to be short and send far
too many at its start.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Mapping, Sequence
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


def _kaplan_meier(ends: list[int], running: Sequence[int]) -> tuple[list[int], list[float]]:
    """The survival curve P(length > t), as (t, S(t)) at each distinct finished length t,
    from sorted finished lengths and sorted lengths reached by answers still running."""
    times: list[int] = []
    surv: list[float] = []
    s, i, j = 1.0, 0, 0
    while i < len(ends):
        t = ends[i]
        k = bisect_right(ends, t, i)
        j = bisect_left(running, t, j)  # running answers shorter than t are not at risk
        s *= 1.0 - (k - i) / (len(ends) - i + len(running) - j)
        times.append(t)
        surv.append(s)
        i = k
    return times, surv


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
        self._running: dict[str, list[int]] = {}  # per category, sorted
        # Survival curves built since the last change; the key None: every category's.
        self._curves: dict[str | None, tuple[list[int], list[float]]] = {}
        # The area under each curve up to each of its times (for expected lengths).
        self._areas: dict[str | None, list[float]] = {}

    def running(self, written: Mapping[str, Sequence[int]]) -> None:
        """The tokens written so far by every answer still running, per category."""
        running = {c: sorted(xs) for c, xs in written.items() if xs}
        if running != self._running:  # told again per server: rebuild curves only on change
            self._running = running
            self._curves.clear()
            self._areas.clear()

    def learn_prior(self, category: str, done: int, output_tokens: int) -> None:
        """Output lengths recorded by earlier runs (a count and a total) seed the mean."""
        if done:
            p = self._prior.setdefault(category, _Prior())
            p.n += done
            p.total += output_tokens

    def add(self, category: str, output_tokens: int) -> None:
        self._by_cat.setdefault(category, _Sorted()).add(output_tokens)
        self._all.add(output_tokens)
        self._curves.clear()
        self._areas.clear()

    @property
    def learned(self) -> bool:
        """Whether enough answers have finished for the distribution to replace the prior."""
        return len(self._all.xs) >= MIN_SAMPLES

    def _learned(self, category: str) -> _Sorted | None:
        own = self._by_cat.get(category)
        if own is not None and len(own.xs) >= MIN_SAMPLES:
            return own
        return self._all if len(self._all.xs) >= MIN_SAMPLES else None

    def _survival(self, category: str, learned: _Sorted) -> tuple[list[int], list[float]]:
        key = category if learned is not self._all else None
        curve = self._curves.get(key)
        if curve is None:
            running = (self._running.get(category, []) if key is not None
                       else sorted(x for xs in self._running.values() for x in xs))
            curve = self._curves[key] = _kaplan_meier(learned.xs, running)
        return curve

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
        times, surv = self._survival(category, learned)

        def s(x: float) -> float:
            i = bisect_right(times, x)
            return surv[i - 1] if i else 1.0

        alive = s(written)
        if alive == 0.0:
            # Longer than every answer seen: assume it runs on to max_tokens.
            return [1.0 if h < left else 0.0 for h in ahead]
        return [s(written + h) / alive if h < left else 0.0 for h in ahead]

    def expected_left(self, category: str, max_tokens: int, written: int = 0) -> float:
        """Tokens an answer that has written `written` will still write, on average: the
        area under the survival curve from `written` on, over S(written) (the running
        answers counted as censored; past every length seen it runs to max_tokens). With
        `written` 0, the mean length. Until learned: the prior, as `still_running`."""
        learned = self._learned(category)
        if learned is None:
            prior = self._prior.get(category)
            ends = min(max_tokens, prior.total / prior.n) if prior is not None else max_tokens / 2
            return ends - written if written < ends else float(max(max_tokens - written, 0))
        key = category if learned is not self._all else None
        times, surv = self._survival(category, learned)
        areas = self._areas.get(key)
        if areas is None:
            areas, total, last, alive = [], 0.0, 0, 1.0
            for t, s in zip(times, surv, strict=True):
                total += (t - last) * alive
                areas.append(total)
                last, alive = t, s
            self._areas[key] = areas

        def area(x: float) -> tuple[float, float]:  # (integral of S from 0 to x, S(x))
            i = bisect_right(times, x)
            if not i:
                return x, 1.0
            return areas[i - 1] + (x - times[i - 1]) * surv[i - 1], surv[i - 1]

        end = float(max_tokens)
        if written >= end:
            return 0.0
        at, alive = area(written)
        if alive == 0.0:
            return end - written  # longer than every answer seen: runs on to max_tokens
        return (area(end)[0] - at) / alive

    def tail(self, category: str, max_tokens: int, q: float) -> float:
        """The length a share `q` of answers stay within, from the survival curve (the
        running answers counted); max_tokens until learned, or where the curve does not
        fall that far."""
        learned = self._learned(category)
        if learned is None:
            return float(max_tokens)
        times, surv = self._survival(category, learned)
        at = next((t for t, s in zip(times, surv, strict=True) if s <= 1.0 - q), max_tokens)
        return float(min(max_tokens, at))

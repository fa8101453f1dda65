"""Successive halving within a time budget: cheap measurements of every candidate first,
longer ones of the few that lead.

Rung 0 measures the reference, then every candidate of the grid, for `base_s` each (plus
the launch, verification and probe, which a candidate pays once per rung). With `combine`,
the best value of every lever that beat the reference is then tried together. Each later
rung measures `eta` times longer the best `1/eta` of the previous rung's candidates that
passed the probe and were not clearly slower than the reference — and the reference again,
so that every comparison is paired, measured alike and close in time. It ends when a rung
measured a single candidate, after `max_rungs`, or when the next trial would overrun the
budget (its window plus the slowest launch seen so far). The reference's first trial always
runs; a candidate that `skip` says cannot pay, from what the reference's window showed (the
combined one too), is recorded as skipped instead of measured.

A candidate stands or falls by its longest measurement (`standing`): one that failed at a
later rung (out of memory in the longer window, say) is out, whatever its shorter numbers
showed. It is compared with the reference at the highest rung where both were measured: a
reference that fails at a later rung ends the halving there (nothing measured beside it
could be compared), and the comparisons already made stand. The answer is the leader of
the highest rung where a candidate stands, if it beats the reference by the margin.

Every trial is recorded as it ends (`record`), and a trial found among `recorded` is
reused, never measured again: a tune stopped anywhere continues where it stopped, and its
budget counts what the earlier sessions spent.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from draftgen.clock import REAL_CLOCK, Clock
from draftgen.servers.tune_section import Levers
from draftgen.tune.candidates import COMBINED, REFERENCE, Candidate, candidate_for, combine
from draftgen.tune.directory import Trial

# (candidate, rung, seconds to measure) -> its trial, failures included.
MeasureFn = Callable[[Candidate, int, float], Awaitable[Trial]]
# Why a candidate need not be measured, given the reference's first trial; None: measure it.
SkipFn = Callable[[Candidate, Trial], str | None]
# A trial's predicted duration of the whole job, given every trial so far (their pooled
# answer lengths); None when it cannot be told.
Objective = Callable[[Trial, Sequence[Trial]], float | None]


def standing(trials: Mapping[tuple[str, int], Trial], cid: str) -> tuple[Trial, int | None]:
    """A candidate's last trial (its longest measurement), and the rung at which it is
    compared with the reference: the highest where both were measured and usable. None
    when its last trial is not usable (it is out) or no rung pairs it with the reference.
    The reference's own: its highest usable rung. Raises KeyError for one never tried."""
    mine = sorted((t for (c, _), t in trials.items() if c == cid), key=lambda t: t.rung)
    if not mine:
        raise KeyError(cid)
    last = mine[-1]
    if not last.usable:
        usable = [t.rung for t in mine if t.usable] if cid == REFERENCE else []
        return last, max(usable, default=None)
    for t in reversed(mine):
        ref = trials.get((REFERENCE, t.rung))
        if t.usable and ref is not None and ref.usable:
            return last, t.rung
    return last, None


@dataclass(frozen=True)
class SearchOptions:
    budget_s: float
    base_s: float = 20.0
    eta: int = 2
    max_rungs: int = 3
    # A candidate must beat the reference by this share to be called faster (run-to-run
    # noise of a short measurement is a few percent).
    margin: float = 0.03
    combine: bool = True

    def seconds(self, rung: int) -> float:
        return self.base_s * float(self.eta) ** rung


@dataclass(frozen=True)
class SearchOutcome:
    candidates: tuple[Candidate, ...]
    trials: tuple[Trial, ...]
    best: Candidate | None  # None: nothing beat the reference by the margin
    best_trial: Trial | None
    reference_trial: Trial | None  # the reference's trial paired with best (or its last)
    spent_s: float
    budget_stopped: bool
    notes: tuple[str, ...] = ()


class _Search:
    def __init__(self, grid: Sequence[Candidate], measure: MeasureFn, recorded: Sequence[Trial],
                 record: Callable[[Trial], None], objective: Objective, opts: SearchOptions,
                 clock: Clock, skip: SkipFn | None) -> None:
        self.cands = {c.id: c for c in grid}
        self.skip = skip
        self.order = [c.id for c in grid]
        self.measure, self.record, self.objective = measure, record, objective
        self.opts, self.clock = opts, clock
        self.done = {(t.candidate, t.rung): t for t in recorded}
        self.earlier_s = sum(t.cost_s for t in recorded)
        self.started = clock.monotonic()
        self.stopped = False
        self.notes: list[str] = []

    def spent(self) -> float:
        return self.earlier_s + self.clock.monotonic() - self.started

    def _estimate(self, seconds: float) -> float:
        # The slowest launch (+ verify, probe) seen so far: a budget is a limit, not a target.
        overheads = [t.cost_s - t.seconds for t in self.done.values() if t.cost_s > t.seconds]
        return seconds + max(overheads, default=0.0)

    async def trial(self, cand: Candidate, rung: int, *, forced: bool = False) -> Trial | None:
        found = self.done.get((cand.id, rung))
        if found is not None:
            return found
        seconds = self.opts.seconds(rung)
        if self.stopped or (not forced and
                            self.spent() + self._estimate(seconds) > self.opts.budget_s):
            self.stopped = True
            return None
        t = await self.measure(cand, rung, seconds)
        self.record(t)
        self.done[(cand.id, rung)] = t
        return t

    def _skipped(self, cand: Candidate, why: str) -> None:
        t = Trial(cand.id, 0, cand.levers.changes(), cand.origin, "skipped", reason=why,
                  finished_at=self.clock.time())
        self.record(t)
        self.done[(cand.id, 0)] = t

    def value(self, cid: str, rung: int) -> float | None:
        t = self.done.get((cid, rung))
        if t is None or not t.usable:
            return None
        return self.objective(t, list(self.done.values()))

    def ratio(self, cid: str, rung: int) -> float | None:
        """The candidate's predicted duration over the reference's, measured at one rung."""
        mine, ref = self.value(cid, rung), self.value(REFERENCE, rung)
        if mine is None or ref is None or ref <= 0:
            return None
        return mine / ref

    def _combined_candidate(self) -> Candidate | None:
        for t in self.done.values():
            if t.origin == COMBINED:
                return candidate_for(Levers.model_validate(t.levers), COMBINED)
        margin = self.opts.margin

        def gain(c: Candidate) -> float | None:
            r = self.ratio(c.id, 0)
            return r if r is not None and r <= 1 - margin else None

        return combine([self.cands[i] for i in self.order], gain)

    async def run(self) -> None:
        """Measure rung after rung (see the module docstring)."""
        ref = self.cands[REFERENCE]
        first = await self.trial(ref, 0, forced=True)
        if first is None or not first.usable:
            return
        for cid in self.order[1:]:
            await self._first_rung(self.cands[cid], first)
        if self.opts.combine:
            # Listed even when the budget is out: the table shows what would have been next.
            extra = self._combined_candidate()
            if extra is not None and extra.id not in self.cands:
                self.cands[extra.id] = extra
                self.order.append(extra.id)
                await self._first_rung(extra, first)
        rung, measured = 0, list(self.order[1:])
        while rung + 1 < self.opts.max_rungs and not self.stopped:
            alive = [c for c in measured if (r := self.ratio(c, rung)) is not None
                     and r < 1 + self.opts.margin]
            if not alive or (rung > 0 and len(measured) <= 1):
                break
            alive.sort(key=lambda c: self.ratio(c, rung) or math.inf)
            keep = alive[:max(1, math.ceil(len(alive) / self.opts.eta))]
            rung += 1
            paired = await self.trial(ref, rung)
            if paired is not None and not paired.usable:
                self.notes.append(
                    f"the reference was {paired.status} at rung {rung} ({paired.reason}): "
                    f"nothing longer could be compared, so the comparisons stand at rung "
                    f"{rung - 1}")
                break
            for cid in keep:
                await self.trial(self.cands[cid], rung)
            measured = keep

    async def _first_rung(self, cand: Candidate, first: Trial) -> None:
        """Measure a candidate briefly, unless the reference's first trial shows it cannot
        pay (a skip, recorded; one recorded before is never asked again)."""
        if (cand.id, 0) not in self.done and self.skip is not None:
            why = self.skip(cand, first)
            if why is not None:
                self._skipped(cand, why)
                return
        await self.trial(cand, 0)

    def best(self) -> tuple[Candidate | None, Trial | None, Trial | None]:
        """The leader of the highest rung where a candidate stands (see the module
        docstring), if it beats the reference by the margin (of near-equals, the fewest
        changes); with the reference's trial at that rung."""
        scored: dict[int, list[tuple[float, str]]] = {}
        for cid in self.order[1:]:
            if not any(c == cid for c, _ in self.done):
                continue
            _, rung = standing(self.done, cid)
            r = self.ratio(cid, rung) if rung is not None else None
            if rung is not None and r is not None:
                scored.setdefault(rung, []).append((r, cid))
        if not scored:
            if any(c == REFERENCE for c, _ in self.done):
                _, ref_rung = standing(self.done, REFERENCE)
                return None, None, self.done.get((REFERENCE, ref_rung or 0))
            return None, None, None
        rung = max(scored)
        ref_trial = self.done[(REFERENCE, rung)]
        winners = [(r, c) for r, c in scored[rung] if r <= 1 - self.opts.margin]
        if not winners:
            return None, None, ref_trial
        # Within the margin of the fastest, the one that changes fewest levers: a lever
        # that gains nothing measurable (twice the KV memory, say) is not worth taking.
        fastest = min(r for r, _ in winners)
        _, _, cid = min((len(self.cands[c].levers.changes()), r, c)
                        for r, c in winners if r <= fastest + self.opts.margin)
        return self.cands[cid], self.done[(cid, rung)], ref_trial


async def search(grid: Sequence[Candidate], measure: MeasureFn, *, recorded: Sequence[Trial],
                 record: Callable[[Trial], None], objective: Objective, opts: SearchOptions,
                 clock: Clock = REAL_CLOCK, skip: SkipFn | None = None) -> SearchOutcome:
    """Run the search (see the module docstring); `grid[0]` must be the reference."""
    if not grid or not grid[0].is_reference:
        raise ValueError("the grid must start with the reference")
    s = _Search(grid, measure, recorded, record, objective, opts, clock, skip)
    await s.run()
    best, best_trial, ref_trial = s.best()
    return SearchOutcome(
        candidates=tuple(s.cands[c] for c in s.order),
        trials=tuple(sorted(s.done.values(), key=lambda t: (t.rung, s.order.index(t.candidate)
                                                             if t.candidate in s.order else 0))),
        best=best, best_trial=best_trial, reference_trial=ref_trial,
        spent_s=s.spent(), budget_stopped=s.stopped,
        notes=tuple(s.notes))

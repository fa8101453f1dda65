"""A trial's answer to "how long would the whole job take on this configuration?".

The capacity model (`planning.capacity.predict`) runs the job's whole plan against the
server a trial measured: its KV capacity (as the server reported it), its running-request
limit, and the decode speed against batch size that the job's own requests got in the
window. Answer lengths are pooled over every trial whose server passed (and over a
finished run of the job, when given): they belong to the job, not to a configuration, and
one window sees too few of them, mostly the short ones. A short window cannot show a cache
filling up hours into a run; the model does.

The same model answers two more questions of the tune:

- `kv_demand`: the KV cache the job would ask of a server — the requests it keeps running
  there (its concurrency, within the running limit) times the duration-weighted mean
  footprint of one (prompt + half its answer), and whether the simulation of the whole job
  preempts. A group of answers the window mostly left unfinished counts at the model's
  prior (half of max_tokens), not at the few short ones that finished, unless a run of the
  job (`--lengths-from`) gave its lengths: the "did not bind" skip must not take a window
  too short for a reasoning answer as evidence that the cache stays empty.
- `explain`: why a prediction runs against its own window — a candidate measured faster
  than the reference at the same rung, yet predicted to take longer (or the reverse). The
  terms that can turn it: how many of the job's requests run at once (the KV cache by the
  job's footprint, the running limit), the decode speed at that many, and preemption in
  the simulation. A contradiction none of them explains is reported as a bug.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from draftgen.planning.capacity import Prediction, predict
from draftgen.planning.workload import DecodeSpeed, ServerCapacity, Workload
from draftgen.sample import Sample
from draftgen.tune.directory import Trial

Group = tuple[str, str]


@dataclass(frozen=True)
class KvDemand:
    """The KV cache the whole job would ask of a server, by the capacity model."""

    running: float  # requests the job keeps running there: its concurrency, within the limit
    footprint: float  # the KV tokens one of them holds, on average over its life
    concurrency: float  # what the job keeps in flight
    preemptions: int = 0  # what the simulation of the whole job preempts there

    @property
    def tokens(self) -> float:
        return self.running * self.footprint


@dataclass
class JobModel:
    samples: Sequence[Sample]
    concurrency: Mapping[str, int]
    seed: int = 0
    # Answer lengths from a finished or partial run of this job, per (category, partition).
    known_lengths: Mapping[Group, Sequence[int]] = field(default_factory=dict)
    _cache: dict[tuple[str, str, int, int], Prediction | None] = field(default_factory=dict)

    def lengths(self, trials: Sequence[Trial]) -> dict[Group, list[int]]:
        pooled: dict[Group, list[int]] = {k: list(v) for k, v in self.known_lengths.items()}
        for t in trials:
            if not t.usable:
                continue
            for key, values in t.lengths.items():
                cat, _, part = key.partition("/")
                pooled.setdefault((cat, part), []).extend(values)
        return pooled

    def seconds(self, trial: Trial, trials: Sequence[Trial], *,
                rejected_too: bool = False) -> float | None:
        """The job's predicted duration on the trial's server; None when it cannot be told,
        or when the server is out (failed the probe) unless `rejected_too` (for a table
        that shows what the loss would have bought)."""
        p = self.prediction(trial, trials, rejected_too=rejected_too)
        return p.duration_s if p is not None else None

    def prediction(self, trial: Trial, trials: Sequence[Trial], *,
                   rejected_too: bool = False) -> Prediction | None:
        """The capacity model's whole answer for the trial's server (see `seconds`)."""
        allowed = trial.usable or (rejected_too and trial.status == "rejected")
        if not allowed:
            return None
        # Trials are only ever added: their number versions the pooled lengths.
        key = ("job", trial.candidate, trial.rung, len(trials))
        if key not in self._cache:
            self._cache[key] = self._predict(trial, self.lengths(trials))
        return self._cache[key]

    def kv_demand(self, trial: Trial) -> KvDemand | None:
        """The job's KV demand on the trial's server, from what its own window and a run of
        the job showed of the answers (see the module docstring); None: cannot be told."""
        key = ("demand", trial.candidate, trial.rung, 0)
        if key not in self._cache:
            self._cache[key] = self._predict(trial, self._demand_lengths(trial))
        p = self._cache[key]
        if p is None:
            return None
        steady = p.steady
        limit = p.server.max_running
        running = steady.concurrency if limit is None else min(steady.concurrency, limit)
        return KvDemand(running=running, footprint=steady.footprint_tokens,
                        concurrency=steady.concurrency, preemptions=p.preemptions)

    def _demand_lengths(self, trial: Trial) -> dict[Group, list[int]]:
        pooled = self.lengths([trial] if trial.usable else [])
        longest: dict[Group, int] = {}
        for s in self.samples:
            group = (s.category, s.partition)
            longest[group] = max(longest.get(group, 0), s.max_tokens)
        for group, max_tokens in longest.items():
            key = f"{group[0]}/{group[1]}"
            seen = len(trial.lengths.get(key, []))
            censored = trial.unfinished.get(key, 0) > seen
            if group in self.known_lengths or (pooled.get(group) and not censored):
                continue
            # Unmeasured, or its long answers outlasted the window: the model's prior.
            pooled[group] = [round(PRIOR_OUTPUT_FRACTION * max_tokens)]
        return pooled

    def _predict(self, trial: Trial, lengths: Mapping[Group, Sequence[int]]
                 ) -> Prediction | None:
        if not trial.speed or not trial.kv_tokens or not self.samples:
            return None
        points = tuple((float(b), float(r)) for b, r in trial.speed if b > 0 and r > 0)
        if not points:
            return None
        server = ServerCapacity(kv_tokens=trial.kv_tokens,
                                speed=DecodeSpeed(points, None, "measured"),
                                block_size=trial.block_size or 1,
                                max_running=trial.max_running)
        workload = Workload.from_samples(self.samples, dict(self.concurrency),
                                         output_samples=lengths)
        return predict(server, workload, seed=self.seed)

    def explain(self, cand: Trial, ref: Trial, trials: Sequence[Trial]) -> str | None:
        """Why `cand`'s prediction runs against its window beside `ref` (the reference at
        the same rung), or None where they agree (see the module docstring)."""
        mine, theirs = (self.seconds(cand, trials, rejected_too=True),
                        self.seconds(ref, trials))
        if not (mine and theirs and cand.tok_s and ref.tok_s):
            return None
        measured, predicted = cand.tok_s / ref.tok_s, mine / theirs
        if abs(measured - 1) <= AGREE or abs(predicted - 1) <= AGREE \
                or (measured > 1) == (predicted < 1):
            return None
        faster = measured > 1
        said = (f"measured {'faster' if faster else 'slower'} than the reference in its "
                f"window ({cand.tok_s:,.1f} vs {ref.tok_s:,.1f} tok/s) but predicted "
                f"{predicted:.2f}× as long")
        pc = self.prediction(cand, trials, rejected_too=True)
        pr = self.prediction(ref, trials)
        term = _term(pc, pr, faster) if pc is not None and pr is not None else None
        return f"{said}: " + (term or "not explained by the capacity model's terms "
                              "(running requests, decode speed, preemption): a bug, "
                              "to be reported")


# Below this relative difference a window and a prediction are not said to disagree.
AGREE = 0.01
PRIOR_OUTPUT_FRACTION = 0.5


def _bound(p: Prediction) -> str:
    s = p.steady
    if s.bound == "kv":
        return (f"its KV cache ({p.server.kv_tokens:,} tokens) holds {int(s.kv_running)} of "
                f"the job's requests ({s.footprint_tokens:,.0f} tokens each on average)")
    if s.bound == "max_running":
        return f"its running limit is {p.server.max_running}"
    return f"the job keeps {s.concurrency:.0f} in flight"


def _term(pc: Prediction, pr: Prediction, faster: bool) -> str | None:
    """The first term of the model that turns the prediction the way it went: against the
    candidate when it was measured faster, for it when slower."""
    sign = 1 if faster else -1
    rc, rr = pc.steady.running, pr.steady.running
    if sign * (rr - rc) > AGREE * rr:
        return (f"the job would run {rc:.0f} requests at once on it against {rr:.0f} on the "
                f"reference: {_bound(pc if faster else pr)}"
                + (f" (the reference: {_bound(pr)})" if faster else ""))
    sc, sr = pc.steady.tok_s, pr.steady.tok_s
    if sign * (sr - sc) > AGREE * sr:
        return (f"at the job's {rc:.0f} running requests its measured decode speed is "
                f"{sc:,.1f} tok/s against the reference's {sr:,.1f}: the window ran at "
                "another batch size")
    if sign * (pc.preemptions - pr.preemptions) > 0:
        return (f"the simulation of the whole job preempts {pc.preemptions} requests on it "
                f"against {pr.preemptions} on the reference: its cache fills with long "
                "answers")
    return None

"""A trial's answer to "how long would the whole job take on this configuration?".

The capacity model (`planning.capacity.predict`) runs the job's whole plan against the
server a trial measured: its KV capacity (as the server reported it), its running-request
limit, and the decode speed against batch size that the job's own requests got in the
window. Answer lengths are pooled over every trial whose server passed (and over a
finished run of the job, when given): they belong to the job, not to a configuration, and
one window sees too few of them, mostly the short ones. A short window cannot show a cache
filling up hours into a run; the model does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from draftgen.planning.capacity import predict
from draftgen.planning.workload import DecodeSpeed, ServerCapacity, Workload
from draftgen.sample import Sample
from draftgen.tune.store import Trial

Group = tuple[str, str]


@dataclass
class JobModel:
    samples: Sequence[Sample]
    concurrency: Mapping[str, int]
    seed: int = 0
    # Answer lengths from a finished or partial run of this job, per (category, partition).
    known_lengths: Mapping[Group, Sequence[int]] = field(default_factory=dict)
    _cache: dict[tuple[str, int, int], float | None] = field(default_factory=dict)

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
        allowed = trial.usable or (rejected_too and trial.status == "rejected")
        if not allowed or not trial.speed or not trial.kv_tokens:
            return None
        # Trials are only ever added: their number versions the pooled lengths.
        key = (trial.candidate, trial.rung, len(trials))
        if key not in self._cache:
            self._cache[key] = self._predict(trial, trials)
        return self._cache[key]

    def _predict(self, trial: Trial, trials: Sequence[Trial]) -> float | None:
        assert trial.speed is not None and trial.kv_tokens is not None
        points = tuple((float(b), float(r)) for b, r in trial.speed if b > 0 and r > 0)
        if not points or not self.samples:
            return None
        server = ServerCapacity(kv_tokens=trial.kv_tokens,
                                speed=DecodeSpeed(points, None, "measured"),
                                block_size=trial.block_size or 1,
                                max_running=trial.max_running)
        workload = Workload.from_samples(self.samples, dict(self.concurrency),
                                         output_samples=self.lengths(trials))
        return predict(server, workload, seed=self.seed).duration_s

"""The tune directory: what a tune measured, so that running it again continues.

    tune.json            what the tune is for (`tuner.tune_key`): the reference profile's
                         hash, its `tune:` section (the draft model too), the engine
                         release, the job's plan digest, the options that shape a
                         measurement, the probe's sizes and thresholds
    tune.jsonl           one `Trial` per candidate and rung, appended (fsynced) by the one
                         search loop that owns the file; a torn last line is cut on open
    reference_probe.json the reference's side of the A/B probe (`referee.py`)
    servers/<id>/        each candidate's server log, pid and summary
    best.yaml, tune.png  the result (`result.py`)

A directory made for another profile, tune section, engine release, job, measurement or
probe is refused, never mixed in. No file here holds an API key (see `measure.py`, `result.py`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import orjson

from draftgen.errors import JobError
from draftgen.store.atomic import disk_error, write_atomic

HEADER = "tune.json"
TRIALS = "tune.jsonl"
REFERENCE_PROBE = "reference_probe.json"

# measured: launched, verified, probed (or the reference) and measured; rejected: the probe
# failed (it was measured all the same, to show what the loss would have bought); failed:
# it did not start, answer or measure; refused: never launched (quality policy, preflight,
# a lever the profile cannot take); skipped: not tried, since the reference's window showed
# that what the lever changes did not bind (a KV cache far from full, a running limit never
# reached).
Status = Literal["measured", "rejected", "failed", "refused", "skipped"]


@dataclass(frozen=True)
class Trial:
    """One candidate measured at one rung of the search."""

    candidate: str
    rung: int
    levers: dict[str, Any]
    origin: str
    status: Status
    reason: str = ""
    seconds: float = 0.0  # the measurement window asked for
    cost_s: float = 0.0  # the whole trial: launch, verify, probe, measure, stop
    launch_s: float | None = None
    kv_tokens: int | None = None
    block_size: int | None = None
    max_running: int | None = None
    kv_dtype: str | None = None
    headroom_gib: float | None = None
    summary: str = ""
    tok_s: float | None = None  # output tokens/s the job's own requests got in the window
    # (running, tok/s) points from the window's decode intervals.
    speed: list[list[float]] | None = None
    # Output lengths of answers finished in the window, per "category/partition".
    lengths: dict[str, list[int]] = field(default_factory=dict)
    # Requests still running at the window's end, per "category/partition".
    unfinished: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    # mean_kl, p95_kl, top1_agreement, exact_match_rate, positions, passed, failures.
    probe: dict[str, Any] | None = None
    # The server's load in the window: kv_peak (0..1), running_peak, waiting_peak, preempted.
    load: dict[str, Any] | None = None
    finished_at: float = 0.0

    @property
    def usable(self) -> bool:
        """Measured and allowed: the reference, or a candidate that passed the probe."""
        return self.status == "measured"

    def to_line(self) -> bytes:
        return orjson.dumps(asdict(self)) + b"\n"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trial:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class TuneDir:
    path: Path
    torn_bytes: int = 0

    def open(self, header: dict[str, Any]) -> list[Trial]:
        """Create or reopen the directory for `header`; the trials recorded so far."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JobError(f"{self.path}: cannot create the tune directory: {e.strerror}") \
                from None
        head = self.path / HEADER
        if head.exists():
            try:
                old = orjson.loads(head.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                old = None
            different = [k for k in header if not isinstance(old, dict) or old.get(k) != header[k]]
            if different:
                raise JobError(
                    f"{self.path} holds a tune of another {', '.join(different)}; give another "
                    "tune directory, or delete this one to start again")
        else:
            write_atomic(head, orjson.dumps(header, option=orjson.OPT_INDENT_2))
        return self._load()

    def _load(self) -> list[Trial]:
        path = self.path / TRIALS
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.torn_bytes = len(data) - end
        if self.torn_bytes:
            # A kill mid-append: the trial is measured again.
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        trials = []
        for line in data[:end].splitlines():
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):
                row = orjson.loads(line)
                if isinstance(row, dict):
                    trials.append(Trial.from_json(row))
        return trials

    def append(self, trial: Trial) -> None:
        path = self.path / TRIALS
        try:
            with open(path, "ab") as f:
                f.write(trial.to_line())
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise disk_error(self.path, e) from None

    @property
    def reference_probe(self) -> Path:
        return self.path / REFERENCE_PROBE

    @property
    def servers(self) -> Path:
        return self.path / "servers"

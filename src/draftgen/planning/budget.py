"""Caps that fit a time budget, and a job file that carries them.

A category's `cap` keeps the first N prompts of its seeded shuffle, so the plan of a capped
job is a prefix of each category's samples in the uncapped plan. Caps are found by running
the capacity model (`capacity.predict`) on such prefixes and bisecting:

- **proportional**: every category keeps the same fraction of its prompts, the largest
  fraction whose predicted duration fits;
- **priority**: categories are kept whole in priority order (the listed ones first, then
  the rest in plan order) while they fit; the first that does not fit whole gets the
  largest cap that fits, and those after it get 0.

Duration is that of the simulation, tail included, so a cap on a long-output category buys
more time than its share of samples suggests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from draftgen.errors import JobError
from draftgen.job import JobSpec, load_job
from draftgen.planning.capacity import Prediction, predict

Mode = Literal["proportional", "priority"]
_MAX_TRIALS = 24
# Within this share of the budget is close enough: lengths are drawn, not known.
_CLOSE_ENOUGH = 0.002


@dataclass(frozen=True, slots=True)
class CapPlan:
    caps: dict[str, int]  # prompts to keep, per category (every category of the plan)
    prompts: dict[str, int]  # prompts the plan has now, per category
    prediction: Prediction  # of the capped plan
    budget_s: float
    mode: Mode

    @property
    def fits(self) -> bool:
        return self.prediction.duration_s <= self.budget_s

    @property
    def reduced(self) -> dict[str, int]:
        """Only the categories that lose prompts."""
        return {c: n for c, n in self.caps.items() if n < self.prompts[c]}


def category_prompts(plan_summary: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """(prompts, samples) per category from `Plan.summary_rows()` (rows per partition)."""
    out: dict[str, tuple[int, int]] = {}
    for row in plan_summary:
        p, s = out.get(row["category"], (0, 0))
        out[row["category"]] = (p + int(row["prompts"]), s + int(row["samples"]))
    return out


def fit_caps(plan_summary: Sequence[Mapping[str, Any]], prediction: Prediction,
             budget_s: float, *, mode: Mode = "proportional",
             priority: Sequence[str] = ()) -> CapPlan:
    """Caps per category so that the predicted duration fits `budget_s` (see module doc).

    `prediction` is the uncapped plan's, made by `capacity.predict`; its server, workload
    and seed are reused for every trial.
    """
    if budget_s <= 0:
        raise ValueError("budget_s must be positive")
    counts = category_prompts(plan_summary)
    prompts = {c: p for c, (p, _) in counts.items()}
    per_prompt = {c: (s // p if p else 1) for c, (p, s) in counts.items()}
    unknown = [c for c in priority if c not in counts]
    if unknown:
        raise ValueError(f"priority names unknown categories: {unknown}")

    def trial(caps: Mapping[str, int]) -> Prediction:
        take = {c: n * per_prompt[c] for c, n in caps.items()}
        return predict(prediction.server, prediction.workload.take(take), seed=prediction.seed)

    if prediction.duration_s <= budget_s:
        return CapPlan(dict(prompts), prompts, prediction, budget_s, mode)
    if mode == "proportional":
        caps, pred = _fit_proportional(prompts, budget_s, trial, prediction.duration_s)
    elif mode == "priority":
        order = [*priority, *(c for c in counts if c not in priority)]
        caps, pred = _fit_priority(prompts, order, budget_s, trial, prediction.duration_s)
    else:
        raise ValueError(f"mode must be 'proportional' or 'priority', not {mode!r}")
    return CapPlan(caps, prompts, pred, budget_s, mode)


def propose_caps(plan_summary: Sequence[Mapping[str, Any]], prediction: Prediction,
                 budget_s: float, *, mode: Mode = "proportional",
                 priority: Sequence[str] = ()) -> dict[str, int]:
    """Prompts to keep per category so the run fits `budget_s`; see `fit_caps`."""
    return fit_caps(plan_summary, prediction, budget_s, mode=mode, priority=priority).caps


Trial = Callable[[Mapping[str, int]], Prediction]


def _search(make: Callable[[float], dict[str, int]], budget_s: float, trial: Trial,
            full_s: float, resolution: float) -> tuple[dict[str, int], Prediction]:
    """The largest x in [0, 1] whose caps `make(x)` fit; x = 1 is known not to fit (it
    takes `full_s`) and x = 0 (nothing) always fits.

    Duration is close to linear in x, so the next trial interpolates between the bracket's
    ends (regula falsi), falling back to halving when one end stops moving; a plan of 10^5
    samples then needs a handful of simulations instead of a dozen.
    """
    lo, lo_s = 0.0, 0.0
    best = make(0.0)
    best_pred = trial(best)
    hi, hi_s = 1.0, full_s
    last_side = ""
    for _ in range(_MAX_TRIALS):
        if hi - lo <= resolution or budget_s - lo_s <= _CLOSE_ENOUGH * budget_s:
            break
        x = lo + (budget_s - lo_s) * (hi - lo) / (hi_s - lo_s) if hi_s > lo_s else hi
        if not lo + resolution / 2 < x < hi - resolution / 2 or last_side.endswith("ll") \
                or last_side.endswith("hh"):
            x = (lo + hi) / 2
            last_side = ""
        caps = make(x)
        pred = trial(caps)
        if pred.duration_s <= budget_s:
            lo, lo_s, best, best_pred = x, pred.duration_s, caps, pred
            last_side += "l"
        else:
            hi, hi_s = x, pred.duration_s
            last_side += "h"
    return best, best_pred


def _fit_proportional(prompts: Mapping[str, int], budget_s: float, trial: Trial,
                      full_s: float) -> tuple[dict[str, int], Prediction]:
    return _search(lambda f: {c: int(f * n) for c, n in prompts.items()}, budget_s, trial,
                   full_s, 1 / max(1, *prompts.values()))


def _fit_priority(prompts: Mapping[str, int], order: list[str], budget_s: float,
                  trial: Trial, full_s: float) -> tuple[dict[str, int], Prediction]:
    def whole_up_to(j: int) -> dict[str, int]:
        return {c: (prompts[c] if i < j else 0) for i, c in enumerate(order)}

    # Fitting is monotone in how many categories are whole: bisect on that count first.
    lo, hi = 0, len(order)  # whole_up_to(lo) fits; whole_up_to(hi) does not (uncapped plan)
    hi_s = full_s
    while hi - lo > 1:
        mid = (lo + hi) // 2
        d = trial(whole_up_to(mid)).duration_s
        if d <= budget_s:
            lo = mid
        else:
            hi, hi_s = mid, d
    partial = order[lo]
    kept = whole_up_to(lo)

    def make(f: float) -> dict[str, int]:
        return {**kept, partial: int(f * prompts[partial])}

    return _search(make, budget_s, trial, hi_s, 1 / max(1, prompts[partial]))


HEADER = (
    "# Written by draftgen from {src}: per-category caps that fit a time budget.\n"
    "# A PyYAML round trip: the original's comments and formatting were not kept.\n"
)


def write_job_with_caps(job_path: str | Path, caps: Mapping[str, int],
                        new_path: str | Path) -> Path:
    """Copy a job file with `cap` set for the named categories; other content is kept.

    Relative paths in the job are rewritten so they still point at the same files from the
    new file's directory. The result is validated by loading it.
    """
    src, dst = Path(job_path), Path(new_path)
    raw = yaml.safe_load(src.read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or not isinstance(raw.get("categories"), list):
        raise JobError(f"{src}: not a job file (no categories list)")
    names = {c.get("name") for c in raw["categories"] if isinstance(c, dict)}
    unknown = sorted(set(caps) - names)
    if unknown:
        raise JobError(f"{src}: caps name unknown categories: {unknown}")
    for cat in raw["categories"]:
        if cat.get("name") in caps:
            cat["cap"] = int(caps[cat["name"]])
    _rebase_paths(raw, src.resolve().parent, dst.resolve().parent)
    text = HEADER.format(src=src) + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text, encoding="utf-8")
    load_job(dst)
    return dst


def _rebase_paths(raw: dict[str, Any], old: Path, new: Path) -> None:
    if old == new:
        return

    def rebase(p: str) -> str:
        path = Path(p).expanduser()
        return p if path.is_absolute() else os.path.relpath(old / path, new)

    # Without an `output`, the default would resolve from the new directory: pin the old one.
    raw.setdefault("output", JobSpec.model_fields["output"].default)
    for key in ("tokenizer", "api_key_file", "output"):
        if isinstance(raw.get(key), str):
            raw[key] = rebase(raw[key])
    for server in raw.get("servers") or []:
        for key in ("launch", "profile"):
            if isinstance(server, dict) and isinstance(server.get(key), str):
                server[key] = rebase(server[key])
    for cat in raw["categories"]:
        source = cat.get("source") if isinstance(cat, dict) else None
        if not isinstance(source, dict):
            continue
        if isinstance(source.get("path"), str):
            source["path"] = rebase(source["path"])
        # A dataset name (org/name) stays; only a local dataset folder moves with the file.
        hf = source.get("hf_dataset")
        if isinstance(hf, str) and (old / hf).exists():
            source["hf_dataset"] = rebase(hf)


__all__ = ["CapPlan", "category_prompts", "fit_caps", "propose_caps", "write_job_with_caps"]

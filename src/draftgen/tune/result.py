"""What a tune found: a row per candidate, the best profile written, speed against drift.

Each row shows a candidate at the rung it is judged by (`search.standing`): what the server
reported (KV tokens, headroom), what the job's requests got (tok/s), the job's predicted
duration and its ratio to the reference measured alongside, the probe (KL, top-1, verdict)
and, for a candidate that is out, why — one whose longest measurement failed shows that
failure, with no ratio, whatever its shorter numbers were. A prediction that runs against
the row's own window (faster measured, predicted longer) is explained in `why` (the term of
the capacity model that turned it). The best configuration is written as a profile `run`
can launch (`servers: [{launch: best.yaml}]`); where no candidate beat the reference, that
is the reference's own settings, and the table says so. The profile's secrets (its
`--api-key`, its env entries named like a key or a token) are not written: they are
REDACTED, and the file's comment says where to put them back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from draftgen.clock import format_duration
from draftgen.probe.drift import ProbeThresholds
from draftgen.reporting.plots import pyplot
from draftgen.servers.keys import API_KEY_FLAG, launch_secrets
from draftgen.servers.profile import ServerProfile
from draftgen.store.atomic import write_atomic
from draftgen.tune.candidates import REFERENCE, Candidate
from draftgen.tune.directory import Trial
from draftgen.tune.search import standing

# What stands in best.yaml for a secret of the reference profile.
SECRET_PLACEHOLDER = "REDACTED"


@dataclass(frozen=True)
class Row:
    candidate: str
    label: str
    origin: str
    status: str  # measured, rejected, failed, refused, skipped, or "not measured"
    rung: int | None = None
    kv_tokens: int | None = None
    headroom_gib: float | None = None
    tok_s: float | None = None  # at its longest measurement
    first_tok_s: float | None = None  # at the first rung, alike for every candidate
    predicted_s: float | None = None
    ratio: float | None = None  # predicted duration / the reference's, measured alongside
    probe_kl: float | None = None
    probe_top1: float | None = None
    verdict: str = ""
    note: str = ""
    # Why its prediction runs against its window (faster measured, predicted longer), where
    # it does: the term of the capacity model that turned it.
    why: str = ""
    # The probe's gate as recorded (paths, floors, verdict), where it ran.
    gate: dict[str, Any] | None = None


@dataclass(frozen=True)
class TuneResult:
    tune_dir: Path
    rows: tuple[Row, ...]
    reference: Row
    best: Row | None  # None: no candidate beat the reference by the margin
    best_profile: Path | None
    plot: Path | None
    saving_s: float | None  # the reference's predicted duration minus the best's
    spent_s: float
    budget_s: float
    budget_stopped: bool
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the reference was measured: without it nothing was compared."""
        return self.reference.status == "measured"


def build_rows(candidates: Sequence[Candidate], trials: Sequence[Trial],
               value: Callable[[Trial], float | None],
               explain: Callable[[Trial, Trial], str | None] | None = None) -> list[Row]:
    """One row per candidate; `value(trial)` is its predicted job duration, `explain(trial,
    reference's trial)` why that prediction runs against the window, where it does."""
    by = {(t.candidate, t.rung): t for t in trials}
    rows = []
    for c in candidates:
        mine = sorted((t for t in trials if t.candidate == c.id), key=lambda t: t.rung)
        if not mine:
            rows.append(Row(c.id, c.label, c.origin, "not measured",
                            note="not measured: the budget ran out"))
            continue
        first, (last, rung) = mine[0], standing(by, c.id)
        probe = first.probe or {}
        verdict = ("reference" if c.id == REFERENCE else
                   "pass" if probe.get("passed") else "FAIL" if probe else
                   "skipped" if last.status == "skipped" else "-")
        if rung is not None:  # judged at `rung`, beside the reference measured there
            shown, status = by[(c.id, rung)], "measured"
            note = ("" if last is shown else
                    f"rung {last.rung}: {last.status}: {last.reason}" if not last.usable else
                    f"rung {last.rung}: not compared (the reference failed there)")
        else:  # out by its longest measurement (or never paired)
            shown, status = last, last.status
            note = last.reason if last.rung == 0 else f"rung {last.rung}: {last.reason}"
        ref = by.get((REFERENCE, shown.rung))
        # A candidate out by its longest measurement has no prediction; a rejected one
        # shows what the loss would have bought.
        predicted = value(shown) if rung is not None or shown.status == "rejected" else None
        ref_value = value(ref) if ref is not None and ref.usable else None
        ratio = predicted / ref_value if predicted and ref_value else None
        why = ""
        if explain is not None and ratio is not None and c.id != REFERENCE \
                and ref is not None:
            why = explain(shown, ref) or ""
        if why:
            note = "; ".join(filter(None, [note, "predicted against its window: see the "
                                           "notes"]))
        rows.append(Row(
            c.id, c.label, c.origin, status, shown.rung, first.kv_tokens,
            first.headroom_gib, shown.tok_s, first.tok_s, predicted, ratio,
            probe.get("mean_kl"), probe.get("top1_agreement"), verdict, note, why,
            probe.get("gate")))
    return rows


def _num(v: float | int | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def format_table(result: TuneResult) -> str:
    """The table and what it means, for a terminal or a log."""
    head = ("candidate", "rung", "KV tokens", "headroom", "tok/s", "job (pred.)", "vs ref",
            "probe KL", "top-1", "verdict", "why out / note")
    lines = [head]
    for r in result.rows:
        lines.append((
            r.label, _num(r.rung, "d"), _num(r.kv_tokens, ","),
            "–" if r.headroom_gib is None else f"{r.headroom_gib:.2f} GiB",
            _num(r.tok_s, ",.1f"), format_duration(r.predicted_s) if r.predicted_s else "–",
            "–" if r.ratio is None else f"{r.ratio:.2f}×", _num(r.probe_kl, ".1e"),
            "–" if r.probe_top1 is None else f"{r.probe_top1:.1%}", r.verdict or "–",
            r.note[:90]))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
           for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("")
    ref = result.reference
    if not result.ok:
        out.append(f"no result: the reference could not be measured ({ref.note})")
    elif result.best is not None and result.saving_s is not None \
            and result.best.ratio is not None:
        b = result.best
        out.append(f"best: {b.label} — the job predicted in {format_duration(b.predicted_s)} "
                   f"against {format_duration((b.predicted_s or 0) + result.saving_s)} "
                   f"with the reference (saves {format_duration(result.saving_s)}, "
                   f"{b.ratio:.2f}×)")
    else:
        out.append(f"best: the reference ({ref.label}) — no passing candidate beat it by "
                   "more than the measurement noise")
    out.append(probe_line(result.rows))
    out.append("tok/s and job (pred.): at the candidate's last rung, the longest measurement "
               "it got (a candidate whose longest measurement failed is out); vs ref: against "
               "the reference measured at that same rung")
    if result.best_profile is not None:
        out.append(f"profile written: {result.best_profile}")
    if result.plot is not None:
        out.append(f"speed against drift: {result.plot}")
    spent = (f"spent {format_duration(result.spent_s)} of a {format_duration(result.budget_s)}"
             " budget")
    left = sum(1 for r in result.rows if r.status == "not measured")
    if result.budget_stopped:
        spent += (f"; stopped by the budget ({left} candidate(s) not measured)" if left else
                  "; stopped by the budget before a longer measurement")
    out.append(spent + f"; trials in {result.tune_dir}")
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)


def probe_line(rows: Sequence[Row]) -> str:
    """Which paths the probe checked, and the reference's own noise on each (the same
    recording meets every candidate, so any candidate's gate shows it)."""
    gate = next((r.gate for r in rows if r.gate), None)
    if not gate:
        return "probe: the prefill path, against fixed thresholds"
    floors = ", ".join(
        f"{p['path']} {p['floor_not_followed']:.1%} of tokens not followed"
        if "floor_not_followed" in p else f"{p['path']} {p['floor_mean_kl']:.1e}"
        for p in gate["paths"])
    return (f"probe: paths checked — prefill (fixed thresholds), "
            f"{', '.join(p['path'] for p in gate['paths'])} (against the reference's own "
            f"noise at {gate['confidence']:.0%} confidence); noise floor, mean KL: {floors}")


def profile_yaml(profile: ServerProfile, comment: Sequence[str]) -> str:
    """A profile file `load_profile` reads back to the same settings (absolute paths), with
    its secrets (`launch_secrets`) REDACTED and a comment naming where they were."""
    clean, places = _without_secrets(profile)
    if places:
        comment = [*comment, f"Secrets of the reference profile are not copied: "
                   f"{SECRET_PLACEHOLDER} stands for the value of {', '.join(places)}; "
                   "put them back before launching."]
        profile = clean
    data: dict[str, Any] = profile.model_dump(mode="json", exclude_defaults=True,
                                              exclude={"tune"})
    data["engine"] = profile.engine
    data["kv_cache_dtype"] = profile.kv_cache_dtype  # explicit, as the policy wants it
    order = list(type(profile).model_fields)
    data = {k: data[k] for k in order if k in data}
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
    return "".join(f"# {line}\n" for line in comment) + body


def _without_secrets(profile: ServerProfile) -> tuple[ServerProfile, list[str]]:
    """The profile with each secret of `launch_secrets` REDACTED, and where they were."""
    secrets = set(launch_secrets(profile))
    args, places = list(profile.extra_args), []
    for i, arg in enumerate(args):
        if arg == API_KEY_FLAG and i + 1 < len(args):
            args[i + 1] = SECRET_PLACEHOLDER
        elif arg.startswith(API_KEY_FLAG + "="):
            args[i] = f"{API_KEY_FLAG}={SECRET_PLACEHOLDER}"
        else:
            continue
        places.append(f"extra_args {API_KEY_FLAG}")
    env = dict(profile.env)
    for name, value in env.items():
        if value in secrets:
            env[name] = SECRET_PLACEHOLDER
            places.append(f"env {name}")
    clean = profile.model_copy(update={"extra_args": args, "env": env})
    clean._source_file = profile.source_file
    return clean, list(dict.fromkeys(places))


def write_profile(path: Path, profile: ServerProfile, comment: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, profile_yaml(profile, comment).encode())
    return path


def provenance(reference: Path, job: Path | None, chosen: str, predicted: str) -> list[str]:
    return [
        f"Written by `draftgen tune` on {time.strftime('%Y-%m-%d %H:%M')} from {reference}",
        f"for the job {job}: {chosen}.",
        predicted,
    ]


def draw_speed_vs_drift(rows: Sequence[Row], thresholds: ProbeThresholds, best: Row | None,
                        path: Path) -> Path:
    """Each measured candidate's first-rung tok/s against its drift (1 − top-1 agreement)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for r in rows:
            if r.first_tok_s is None:
                continue
            drift = 0.0 if r.probe_top1 is None else 100 * (1 - r.probe_top1)
            style = {"reference": ("*", "black"), "pass": ("o", "#55A868"),
                     "FAIL": ("X", "#C44E52")}.get(r.verdict, ("s", "grey"))
            ax.scatter([drift], [r.first_tok_s], marker=style[0], color=style[1], s=80,
                       zorder=3)
            if best is not None and r.candidate == best.candidate:
                ax.scatter([drift], [r.first_tok_s], s=260, facecolors="none",
                           edgecolors="#4C72B0", linewidths=2, zorder=2)
            ax.annotate(r.label[:36], (drift, r.first_tok_s), fontsize=7,
                        xytext=(5, 4), textcoords="offset points")
        limit = 100 * (1 - thresholds.min_top1)
        drifts = [100 * (1 - r.probe_top1) for r in rows if r.probe_top1 is not None]
        # Room on the right for the labels of the points furthest out.
        ax.set_xlim(-0.05 * limit, 1.4 * max([*drifts, limit]))
        ax.axvline(limit, color="#C44E52", linestyle="--", linewidth=1,
                   label=f"probe limit: top-1 agreement {thresholds.min_top1:.0%}")
        ax.set_xlabel("drift from the reference: 1 − top-1 agreement (%)")
        ax.set_ylabel("output tok/s of the job's requests (first measurement)")
        ax.set_title("Candidates: speed against drift (★ reference, ● pass, ✖ fail)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close("all")
    return path

"""PNG plots of a run directory: `draftgen report OUT --plots`.

Drawn from the ledger (every done sample: category, output tokens, truncation, finish
time) and, when present, the time series the run appends to `OUT/timeseries.jsonl`, one
JSON object per line:

    {"t": 1767225600.0,             unix time of the reading
     "in_flight": 120,              draftgen requests in flight
     "tok_s": 3100.5,               output tokens/s (the progress view's window)
     "servers": {"http://h:8000": {"kv_usage": 0.93,     0..1
                                   "running": 96,        decoding at the server
                                   "waiting": 4,         queued at the server
                                   "capacity": 376000}}} KV tokens (optional)

Every field but `t` may be missing or null; a run without the file simply gets no
in-flight/KV plot. matplotlib is an optional dependency (`pip install 'draftgen[plots]'`)
imported only here, with the Agg backend, so this works on machines without a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from draftgen.errors import DraftgenError
from draftgen.store.reading import current_entries

SERIES = "timeseries.jsonl"
_DPI = 110


class PlotError(DraftgenError):
    """Plots cannot be drawn (matplotlib missing, or nothing to draw)."""


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; PlotError when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plots need matplotlib: pip install 'draftgen[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_series(path: Path) -> list[dict[str, Any]]:
    """Rows of a time-series file, oldest first; a torn or bad line is skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    rows = []
    for line in data.splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("t"), int | float):
            rows.append(row)
    rows.sort(key=lambda r: r["t"])
    return rows


def draw_plots(out_dir: str | Path, to_dir: str | Path) -> list[Path]:
    """Write the run's PNG plots into `to_dir`; returns the files written."""
    out, dest = Path(out_dir), Path(to_dir)
    plan, entries = current_entries(out)
    done = []
    for row in plan:
        e = entries.get(row["id"])
        if e is not None and e.fingerprint == row["fingerprint"] and e.status == "done":
            done.append((row["category"], e.time, e.output_tokens, bool(e.truncated),
                         row.get("max_tokens")))
    series = read_series(out / SERIES)
    if not done and not series:
        raise PlotError(f"{out}: no done samples and no {SERIES}: nothing to plot")
    plt = pyplot()
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        if done:
            written.append(_throughput(plt, done, series, dest / "throughput.png"))
            written.append(_lengths(plt, done, dest / "output_lengths.png"))
            written.append(_truncation(plt, done, dest / "truncation.png"))
        if series:
            written.append(_inflight_kv(plt, series, dest / "inflight_kv.png"))
    finally:
        plt.close("all")
    return written


Done = Sequence[tuple[str, float, int, bool, Any]]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def _throughput(plt: Any, done: Done, series: list[dict[str, Any]], path: Path) -> Path:
    t0 = min(t for _, t, *_ in done)
    if series:
        t0 = min(t0, series[0]["t"])
    span = max(t for _, t, *_ in done) - t0
    # About 60 bars whatever the run's length, never finer than a second.
    width = max(1.0, span / 60)
    bins: dict[int, int] = {}
    for _, t, otok, _, _ in done:
        k = int((t - t0) / width)
        bins[k] = bins.get(k, 0) + otok
    scale, unit = _time_unit(span)
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = sorted(bins)
    ax.bar([(k + 0.5) * width / scale for k in xs], [bins[k] / width for k in xs],
           width=width / scale * 0.9, color="#4C72B0",
           label="output tokens/s of samples finished in each interval")
    pts = [((r["t"] - t0) / scale, r["tok_s"]) for r in series if r.get("tok_s") is not None]
    if pts:
        ax.plot(*zip(*pts, strict=True), color="#DD8452", label="streamed tokens/s (run's view)")
    ax.set_xlabel(f"time since start ({unit})")
    ax.set_ylabel("output tokens / s")
    total = sum(o for _, _, o, _, _ in done)
    ax.set_title(f"Throughput: {len(done):,} samples, {total:,} output tokens")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _inflight_kv(plt: Any, series: list[dict[str, Any]], path: Path) -> Path:
    t0 = series[0]["t"]
    scale, unit = _time_unit(series[-1]["t"] - t0)
    xs = [(r["t"] - t0) / scale for r in series]
    fig, ax = plt.subplots(figsize=(9, 4))
    inflight = [r.get("in_flight") for r in series]
    ax.plot(xs, [math.nan if v is None else v for v in inflight], color="#4C72B0",
            label="in flight (draftgen)")
    running = [_sum_servers(r, "running") for r in series]
    waiting = [_sum_servers(r, "waiting") for r in series]
    if any(not math.isnan(v) for v in running):
        ax.plot(xs, running, color="#55A868", label="running (servers)")
    if any(not math.isnan(v) for v in waiting):
        ax.plot(xs, waiting, color="#C44E52", linestyle="--", label="waiting (servers)")
    ax.set_xlabel(f"time since start ({unit})")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    kv = ax.twinx()
    urls = sorted({u for r in series for u in (r.get("servers") or {})})
    for url in urls:
        usage = [_server_value(r, url, "kv_usage") for r in series]
        if any(not math.isnan(v) for v in usage):
            kv.plot(xs, [v * 100 for v in usage], color="#8172B2", alpha=0.8, linewidth=1,
                    label=f"KV usage {url}" if len(urls) > 1 else "KV usage")
    kv.set_ylabel("KV cache usage (%)")
    kv.set_ylim(0, 105)
    lines = ax.get_legend_handles_labels()
    more = kv.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title("Requests in flight and KV cache usage")
    return _save(fig, path)


def _lengths(plt: Any, done: Done, path: Path) -> Path:
    by_cat: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    for cat, _, otok, _, mt in done:
        by_cat.setdefault(cat, []).append(otok)
        if isinstance(mt, int):
            max_tokens[cat] = max(max_tokens.get(cat, 0), mt)
    cats = list(by_cat)
    cols = min(3, len(cats))
    rows = math.ceil(len(cats) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, cat in zip(axes.flat, cats, strict=False):
        vals = by_cat[cat]
        ax.hist(vals, bins=min(40, max(5, len(set(vals)))), color="#4C72B0")
        if cat in max_tokens:
            ax.axvline(max_tokens[cat], color="#C44E52", linestyle="--", linewidth=1,
                       label="max_tokens")
            ax.legend(fontsize=7)
        mean = sum(vals) / len(vals)
        ax.set_title(f"{cat}: n={len(vals):,}, mean {mean:,.0f}", fontsize=9)
        ax.set_xlabel("output tokens", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(cats):]:
        ax.set_visible(False)
    fig.suptitle("Output length per category")
    return _save(fig, path)


def _truncation(plt: Any, done: Done, path: Path) -> Path:
    counts: dict[str, list[int]] = {}
    for cat, _, _, trunc, _ in done:
        n = counts.setdefault(cat, [0, 0])
        n[0] += 1
        n[1] += trunc
    cats = list(counts)
    rates = [100 * counts[c][1] / counts[c][0] for c in cats]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(cats) + 2), 4))
    bars = ax.bar(cats, rates, color="#C44E52")
    for bar, c in zip(bars, cats, strict=True):
        ax.annotate(f"{counts[c][1]}/{counts[c][0]}", (bar.get_x() + bar.get_width() / 2,
                                                       bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("truncated (finish_reason = length), %")
    ax.set_ylim(0, max([*rates, 1.0]) * 1.2)
    ax.set_title("Truncation rate per category")
    ax.tick_params(axis="x", labelrotation=30)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s >= 3 * 86400:
        return 86400.0, "days"
    if span_s >= 3 * 3600:
        return 3600.0, "hours"
    if span_s >= 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _server_value(row: Mapping[str, Any], url: str, key: str) -> float:
    v = ((row.get("servers") or {}).get(url) or {}).get(key)
    return float(v) if isinstance(v, int | float) else math.nan


def _sum_servers(row: Mapping[str, Any], key: str) -> float:
    vals = [s.get(key) for s in (row.get("servers") or {}).values() if isinstance(s, dict)]
    nums = [float(v) for v in vals if isinstance(v, int | float)]
    return sum(nums) if nums else math.nan


__all__ = ["PlotError", "draw_plots", "pyplot", "read_series"]

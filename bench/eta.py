"""The ETA replayed over a finished run: what it said at moments spread over the run against
the time that was really left, for the ETA of running/eta.py and for the one before it
(remaining tokens at the finished answers' mean, in-flight ones at half, over the last
minute's rate), on one recorded run.

Usage: python bench/eta.py RUN_DIR [--save TRACE.json] [--points 40]
   or: python bench/eta.py --trace TRACE.json

The trace (one row per sample: partition, category, start, first token, end, tokens) is
what tests/unit/running/test_eta.py replays; `--save` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.eta_trace import record_trace, replay, streamed


def old_eta(trace: dict[str, Any], t: float) -> float | None:
    """The ETA draftgen printed before running/eta.py (RunStats at 41b8598)."""
    rows = trace["samples"]
    done = [r for r in rows if r[4] <= t]
    flying = Counter(r[1] for r in rows if r[2] <= t < r[4])
    planned = Counter(r[1] for r in rows)
    max_tokens = {r[1]: trace["partitions"][r[0]] for r in rows}
    by_cat: dict[str, list[int]] = {}
    for r in done:
        by_cat.setdefault(r[1], []).append(r[5])
    all_tokens = sum(r[5] for r in done)
    remaining = 0.0
    for cat, n in planned.items():
        got = by_cat.get(cat, [])
        if got:
            mean = sum(got) / len(got)
        elif done:
            mean = min(all_tokens / len(done), max_tokens[cat])
        else:
            mean = max_tokens[cat] / 2
        remaining += mean * (n - len(got) - flying[cat] / 2)

    span = min(60.0, t)
    rate = (sum(streamed(r[3], r[4], r[5], t) - streamed(r[3], r[4], r[5], t - span)
                for r in rows) / span) if span else 0.0
    return max(remaining, 0.0) / rate if rate > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", nargs="?", type=Path)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--save", type=Path)
    ap.add_argument("--points", type=int, default=40)
    args = ap.parse_args()
    if args.trace:
        trace = json.loads(args.trace.read_text())
    elif args.run_dir:
        trace = record_trace(args.run_dir)
    else:
        ap.error("give RUN_DIR or --trace")
    if args.save:
        args.save.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    rows = replay(trace, points=args.points)
    end = rows[-1][0] + rows[-1][1]
    print(f"{len(trace['samples'])} samples, {end:.0f}s; from a tenth of the run on, the "
          "ETA's miss as a share of the time really left")
    print(f"{'t':>7} {'done':>5} {'left':>7} {'ETA':>7} {'miss':>6} {'before':>7} {'miss':>6}")
    worst = {"now": 0.0, "before": 0.0}
    for t, left, eta in rows:
        before = old_eta(trace, t)
        done = sum(r[4] <= t for r in trace["samples"])
        cells = []
        for name, value in (("now", eta), ("before", before)):
            miss = None if value is None else value / left - 1
            if t >= end / 10:
                worst[name] = max(worst[name], float("inf") if miss is None else abs(miss))
            cells += ["-" if value is None else f"{value:.0f}s",
                      "" if miss is None else f"{miss:+.0%}"]
        print(f"{t:6.0f}s {done:5d} {left:6.0f}s {cells[0]:>7} {cells[1]:>6} {cells[2]:>7} "
              f"{cells[3]:>6}")
    print(f"worst miss from a tenth on: now {worst['now']:.0%}, before {worst['before']:.0%}")


if __name__ == "__main__":
    main()

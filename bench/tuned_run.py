"""A job run on the profile `draftgen tune` wrote against the same job on the reference profile.

`draftgen tune` predicts the saving from short windows; this measures it on whole runs.
Each repeat runs the job twice, interleaved (reference, tuned; then tuned, reference on the
next repeat, so neither always runs on a warmer machine), each on an engine launched from
its profile for the run and stopped after, exactly as `draftgen run` does with
`servers: [{launch: PROFILE}]`. Timed is the generation: from the first request sent to the
last answer, read from the run's own records (the launch is the same for both profiles);
reported per profile are the medians, and the tuned/reference ratio paired per repeat.

Usage: python bench/tuned_run.py --job examples/demo/job-tiny.yaml
       --reference examples/profiles/local-cpu.yaml --tuned runs/demo-tune-local-cpu/best.yaml
       [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent


def job_on(job: Path, profile: Path, out: Path, dest: Path) -> Path:
    """A copy of `job` launching `profile`, writing to `out`, with its paths made absolute."""
    data = yaml.safe_load(job.read_text())
    base = job.resolve().parent
    data["servers"] = [{"launch": str(profile.resolve())}]
    data["output"] = str(out)
    for cat in data["categories"]:
        src = cat["source"]
        if "path" in src:
            src["path"] = str(base / src["path"])
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def run_once(job: Path, profile: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        copy = job_on(job, profile, tmp / "out", tmp / "job.yaml")
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "draftgen", "run", str(copy), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        total = time.monotonic() - t0
        recs = [orjson.loads(x) for p in sorted((tmp / "out" / "shards").glob("*"))
                for x in p.read_bytes().splitlines()]
    tokens = sum(t["completion_tokens"] for r in recs for t in r["turns"])
    first = min(r["finished_at"] - sum(t["duration_s"] or 0.0 for t in r["turns"])
                for r in recs)
    gen = max(r["finished_at"] for r in recs) - first
    return {"samples": len(recs), "tokens": tokens, "gen_s": gen, "tok_s": tokens / gen,
            "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, required=True)
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--tuned", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"tuned vs reference — {platform.machine()}, Python {platform.python_version()}, "
          f"`python bench/tuned_run.py {' '.join(sys.argv[1:])}`", flush=True)
    runs: dict[str, list[dict[str, float]]] = {"reference": [], "tuned": []}
    profiles = {"reference": args.reference, "tuned": args.tuned}
    for r in range(args.repeats):
        order = ["reference", "tuned"] if r % 2 == 0 else ["tuned", "reference"]
        for name in order:
            m = run_once(args.job, profiles[name])
            runs[name].append(m)
            print(f"  rep {r + 1} {name}: {m['samples']:.0f} samples, {m['tokens']:,.0f} "
                  f"tokens in {m['gen_s']:.1f} s ({m['tok_s']:,.0f} tok/s); "
                  f"{m['total_s']:.1f} s with launch and stop", flush=True)
    print("\n| profile | samples | tokens | generation s | tok/s | run s (with launch) |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        print(f"| {name} | {med['samples']:.0f} | {med['tokens']:,.0f} | {med['gen_s']:.1f} | "
              f"{med['tok_s']:,.0f} | {med['total_s']:.1f} |")
    ratios = [t["gen_s"] / ref["gen_s"] for t, ref in zip(runs["tuned"], runs["reference"],
                                                         strict=True)]
    print(f"\ngeneration time, tuned / reference, paired per repeat: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()

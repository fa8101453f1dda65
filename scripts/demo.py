"""`make demo`: make the real model (SmolLM2-135M-Instruct, from its package), plan, run
(which launches the real local engine from its profile and stops it after), export, report,
summarise with a few of the answers.

Every step is the real command a user would type.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson

from draftgen.local.smollm2 import build_smollm2

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "demo" / "job.yaml"
OUT = ROOT / "runs" / "demo"
EXPORT = OUT / "export"
DRAFTGEN = [sys.executable, "-m", "draftgen"]


def step(*args: str, show: bool = True) -> str:
    if show:
        print(f"\n$ draftgen {' '.join(args)}", flush=True)
    done = subprocess.run([*DRAFTGEN, *args], cwd=ROOT, check=True, text=True,
                          stdout=subprocess.PIPE)
    if show:
        print(done.stdout, end="", flush=True)
    return done.stdout


def main() -> None:
    t0 = time.monotonic()
    model = build_smollm2(ROOT / ".cache" / "smollm2")
    print(f"model: SmolLM2-135M-Instruct in {model}")
    step("plan", str(JOB))
    # The job launches the local engine from its profile, runs, and stops it.
    step("run", str(JOB), "--out", str(OUT))
    step("status", str(OUT))
    step("report", str(OUT), "--plots")
    lines = [
        step("export", str(OUT), "--format", fmt, "--to", str(EXPORT / name), *extra)
        for fmt, name, extra in (
            ("specforge", "specforge.jsonl", []), ("sharegpt", "sharegpt.jsonl", []),
            ("parquet", "samples.parquet", []),
            ("tokens", "tokens.jsonl", ["--tokenizer", str(model)]))
    ]
    status = orjson.loads(step("status", str(OUT), "--json", show=False))
    print("\n== demo summary ==")
    print(f"samples planned {status['total']}, generated {status['done']}, "
          f"failed {status['failed']}, truncated {status['truncated']}, "
          f"rejected source rows {status['rejected']}, output tokens {status['output_tokens']:,}")
    for line in lines:
        print(line.strip())
    rows = [orjson.loads(r) for r in (EXPORT / "tokens.jsonl").read_bytes().splitlines()]
    from_server = sum(r["metadata"]["token_source"] == "server" for r in rows)
    print(f"token ids from the server (exported as they are): {from_server} of {len(rows)} "
          "rows")
    show_answers(EXPORT / "sharegpt.jsonl")
    print(f"run directory: {OUT}  (run `make demo` again: it resumes and sends nothing)")
    print(f"total {time.monotonic() - t0:.0f}s")


def show_answers(path: Path, n: int = 3, width: int = 300) -> None:
    """A few prompts and the answers the model wrote, one per category first."""
    rows = [orjson.loads(r) for r in path.read_bytes().splitlines()]
    seen: set[str] = set()
    picked = []
    for row in rows:
        category = str(row["id"]).rsplit("-", 1)[0]
        if category not in seen and len(row["conversations"]) == 2 + (
                row["conversations"][0]["from"] == "system"):
            seen.add(category)
            picked.append(row)
    print("\n== a few answers ==")
    for row in picked[:n]:
        turns = row["conversations"]
        ask, answer = turns[-2]["value"], turns[-1]["value"]
        print(f"[{row['id']}] > {clip(ask, width)}")
        print(f"  {clip(answer, width)}\n")


def clip(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


if __name__ == "__main__":
    main()

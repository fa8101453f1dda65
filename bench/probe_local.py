"""The A/B probe on local engine pairs: what drift looks like, measured on the tiny model.

Starts the bf16 reference engine (the launcher's default) and, one at a time, a candidate
engine per configuration, probes it against the reference, and stops it:
  twin      a second bf16 engine with the same settings (a separate process)
  float32   the same model computed in float32 (--dtype float32)
  fp8 KV    bf16 weights and activations, KV cache stored as fp8 (--kv-cache-dtype fp8);
            vLLM's CPU build needs AVX-512 or AMX for it, else the row says it was skipped

All engines run in this process's session (see the engine notes on sched_autogroup).

Usage: python bench/probe_local.py [--n 40] [--max-tokens 64] [--top-k 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
from pathlib import Path

import orjson

from draftgen.local import EngineError, LocalEngine, build_tiny_model
from draftgen.probe import (
    ProbeResult,
    ProbeThresholds,
    format_report,
    load_prompts,
    run_probe,
)

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = {
    "twin (bf16, same settings)": [],
    "float32 (--dtype float32)": ["--dtype", "float32"],
    "fp8 KV (--kv-cache-dtype fp8)": ["--kv-cache-dtype", "fp8"],
}


def row(name: str, r: ProbeResult) -> str:
    div = "-" if r.median_first_divergence is None else f"{r.median_first_divergence:g}"
    return (f"| {name} | {r.mean_kl:.2e} | {r.p95_kl:.2e} | {r.top1_agreement:.2%} | "
            f"{r.exact_match_rate:.0%} | {r.mean_matching_prefix:.1f} | {div} | "
            f"{'pass' if r.passed else 'FAIL'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model_dir = build_tiny_model(Path(os.environ.get("DRAFTGEN_CACHE") or ROOT / ".cache")
                                 / "tiny-model")
    prompts = load_prompts(None)
    logs = Path(tempfile.mkdtemp(prefix="probe-bench-"))
    thresholds = ProbeThresholds()
    lines = [
        "| candidate vs bf16 reference | mean top-k KL | p95 KL | top-1 agree | exact match "
        "| mean matching prefix | median first divergence | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    results: dict[str, object] = {}
    with LocalEngine(model_dir, log_path=logs / "reference.log") as reference:
        for i, (name, extra) in enumerate(CANDIDATES.items()):
            cand = LocalEngine(model_dir, log_path=logs / f"candidate-{i}.log",
                               extra_args=extra)
            try:
                cand.start()
            except EngineError as e:
                lines.append(f"| {name} | skipped: the engine did not start | | | | | | |")
                print(f"{name}: engine did not start: {str(e).splitlines()[0]}",
                      file=sys.stderr)
                continue
            try:
                result = asyncio.run(run_probe(
                    reference.url, cand.url, prompts, n=args.n, max_tokens=args.max_tokens,
                    top_k=args.top_k, model=None, thresholds=thresholds))
            finally:
                cand.stop()
            print(f"\n## {name}\n{format_report(result)}", file=sys.stderr)
            lines.append(row(name, result))
            results[name] = result.to_dict()

    command = (f"python bench/probe_local.py --n {args.n} --max-tokens {args.max_tokens} "
               f"--top-k {args.top_k}")
    print(f"Command: `{command}` — tiny model, vLLM CPU {platform.machine()}, "
          f"{os.cpu_count()} cores; thresholds: mean KL <= {thresholds.max_mean_kl:g}, "
          f"top-1 >= {thresholds.min_top1:.0%}\n")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps({"command": command, "results": results},
                                           option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

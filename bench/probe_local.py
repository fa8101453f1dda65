"""The A/B probe and its gate on local engine pairs: what drift looks like, measured on the
real model (SmolLM2-135M-Instruct) or the tiny one.

Starts the bf16 reference engine (the launcher's default) and, one at a time, a candidate
engine per configuration, probes it against the reference (prefill, and the gate's decode
and cache-read paths against the reference's own noise), and stops it:
  twin      a second bf16 engine with the same settings (a separate process)
  float32   the same model computed in float32 (--dtype float32)
  fp8 KV    bf16 weights and activations, KV cache stored as fp8 (--kv-cache-dtype fp8);
            vLLM's CPU build needs AVX-512 or AMX for it, else the row says it was skipped
  4-bit     the model with its weight matrices rounded to 4 bits (local/rounded.py; groups
            of 32 on the real model, per tensor on the tiny one)

All engines run in this process's session (see the engine notes on sched_autogroup).

Usage: python bench/probe_local.py [--model smollm2|tiny] [--n 40] [--max-tokens 64]
                                   [--top-k 10] [--json FILE]
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
from draftgen.local.rounded import build_rounded_model
from draftgen.local.smollm2 import build_smollm2
from draftgen.probe import (
    ProbeResult,
    ProbeThresholds,
    format_report,
    load_prompts,
    run_probe,
)
from draftgen.probe.gate import GateSettings

ROOT = Path(__file__).resolve().parents[1]

CANDIDATES = {
    "twin (bf16, same settings)": [],
    "float32 (--dtype float32)": ["--dtype", "float32"],
    "fp8 KV (--kv-cache-dtype fp8)": ["--kv-cache-dtype", "fp8"],
    "4-bit weights": None,  # another model folder, the same flags
}


def row(name: str, r: ProbeResult) -> str:
    div = "-" if r.median_first_divergence is None else f"{r.median_first_divergence:g}"
    decode = next((p.summary() for p in (r.gate.paths if r.gate else ())
                   if p.name == "decode"), None)
    gate = ("-" if decode is None else
            f"{decode['candidate_mean_kl']:.2e} / {decode['floor_mean_kl']:.2e} | "
            f"{decode['candidate_top1']:.2%} / {decode['floor_top1']:.2%}")
    return (f"| {name} | {r.mean_kl:.2e} | {r.top1_agreement:.2%} | {gate} | "
            f"{r.exact_match_rate:.0%} | {div} | {'pass' if r.passed else 'FAIL'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    args = parser.parse_args()

    cache = Path(os.environ.get("DRAFTGEN_CACHE") or ROOT / ".cache")
    if args.model == "tiny":
        model_dir, served = build_tiny_model(cache / "tiny-model"), "tiny"
        rounded = build_rounded_model(model_dir, cache / "tiny-model-int4", bits=4)
    else:
        model_dir, served = build_smollm2(cache / "smollm2"), "smollm2"
        rounded = build_rounded_model(model_dir, cache / "smollm2-int4", bits=4, group=32)
    prompts = load_prompts(None)
    logs = Path(tempfile.mkdtemp(prefix="probe-bench-"))
    thresholds = ProbeThresholds()
    lines = [
        "| candidate vs bf16 reference | prefill mean top-k KL | prefill top-1 agree "
        "| decode mean KL / floor | decode top-1 / floor | exact match "
        "| median first divergence | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    results: dict[str, object] = {}

    def engine(folder: Path, log: str, extra: list[str]) -> LocalEngine:
        return LocalEngine(folder, served_name=served, max_model_len=2048,
                           log_path=logs / log, extra_args=extra)

    with engine(model_dir, "reference.log", []) as reference:
        for i, (name, extra) in enumerate(CANDIDATES.items()):
            cand = (engine(rounded, f"candidate-{i}.log", []) if extra is None
                    else engine(model_dir, f"candidate-{i}.log", extra))
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
                    top_k=args.top_k, model=None, thresholds=thresholds,
                    gate=GateSettings(confidence=0.99)))
            finally:
                cand.stop()
            print(f"\n## {name}\n{format_report(result)}", file=sys.stderr)
            lines.append(row(name, result))
            results[name] = result.to_dict()

    command = (f"python bench/probe_local.py --model {args.model} --n {args.n} "
               f"--max-tokens {args.max_tokens} --top-k {args.top_k}")
    print(f"Command: `{command}` — vLLM CPU {platform.machine()}, "
          f"{os.cpu_count()} cores; thresholds: mean KL <= {thresholds.max_mean_kl:g}, "
          f"top-1 >= {thresholds.min_top1:.0%}\n")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps({"command": command, "results": results},
                                           option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

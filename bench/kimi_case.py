"""The Kimi case, on paper: the job's predicted duration for the team's final bf16
configuration, then each lossless lever alone and combined.

    python bench/kimi_case.py [--samples 100000] [--markdown]

KV capacity comes from the memory model (`engines/memory.py`) on the example profile
`examples/profiles/kimi-k2.5-sglang-8gpu.yaml`, fitted to the case's own reading (159,277
tokens, bf16 at mem_fraction 0.88, TP 8); decode speed from the case's readings (the
profile's `speed:` section); the job's duration from the capacity model (`planning/
capacity.py`, a simulation of the whole plan). Every assumption is printed with the table.

The job (DEVELOPERS.md): 100,000 samples over seven categories B1-B7; a short partition
(max 10,240 output tokens, 150 in flight) and a long one (16,384, 32 in flight); answers
averaging 4,000+ tokens. What the account does not give is assumed and said: the split
between partitions, prompt lengths, the shape of the length distribution, the drafter's
acceptance.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftgen.clock import format_duration  # noqa: E402
from draftgen.engines.memory import Layout  # noqa: E402
from draftgen.planning.capacity import predict  # noqa: E402
from draftgen.planning.workload import DecodeSpeed, ServerCapacity, Workload  # noqa: E402
from draftgen.servers.prediction import memory_facts, predict_profile  # noqa: E402
from draftgen.servers.profile import load_profile  # noqa: E402

PROFILE = ROOT / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"
CATEGORIES = [f"B{i}" for i in range(1, 8)]
PARTITIONS = {"short": (10_240, 150), "long": (16_384, 32)}  # max_tokens, in flight
LONG_SHARE = 0.15  # assumed: the account gives the limits, not the split
PROMPT_TOKENS = {"short": 800, "long": 6_000}  # assumed means (drawn ±50%)
MEAN_ANSWER = 4_300  # "4,000+": an exponential-like spread, capped at max_tokens
# The old drafter (speculative decoding, EAGLE-3, 4 draft tokens): assumed mean acceptance
# length 2.4 tokens per verify step, and a verify step 1.6x a plain one at this batch.
SPEC_ACCEPT, SPEC_STEP_COST = 2.4, 1.6
STEPS_AT_ANCHOR = "TP 8, DP attention off, bf16 KV, mem_fraction 0.88, HiCache on"


@dataclass(frozen=True)
class Row:
    name: str
    layout: Layout
    fraction: float
    speculative: bool = False
    max_running: int | None = None
    note: str = ""


ROWS = [
    Row("the team's final bf16 configuration (anchor)", Layout(tp=8), 0.88,
        note=STEPS_AT_ANCHOR),
    Row("mem_fraction 0.90", Layout(tp=8), 0.90),
    Row("mem_fraction 0.92", Layout(tp=8), 0.92),
    Row("DP attention 8", Layout(tp=8, attn_dp=8), 0.88,
        note="8 pools; attention weights whole on every rank"),
    Row("DCP 8", Layout(tp=8, dcp=8), 0.88, note="the latent sharded over the 8 GPUs"),
    Row("speculative decoding (old drafter)", Layout(tp=8), 0.88, speculative=True),
    Row("HiCache off", Layout(tp=8), 0.88,
        note="holds evicted prefixes only: no room for running requests either way"),
    Row("running limit 512 (no change)", Layout(tp=8), 0.88, max_running=512,
        note="binds only once KV holds more than 512 requests"),
    Row("DCP 8 + mem_fraction 0.92", Layout(tp=8, dcp=8), 0.92),
    Row("DCP 8 + mem_fraction 0.92 + speculative", Layout(tp=8, dcp=8), 0.92,
        speculative=True),
]


def workload(samples: int, seed: int) -> Workload:
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(samples):
        part = "long" if rng.random() < LONG_SHARE else "short"
        mean = PROMPT_TOKENS[part]
        rows.append({"category": CATEGORIES[i % len(CATEGORIES)], "partition": part,
                     "prompt_tokens": int(rng.uniform(0.5, 1.5) * mean),
                     "max_tokens": PARTITIONS[part][0]})
    lengths = {(c, p): tuple(max(1, min(int(rng.expovariate(1 / MEAN_ANSWER)), m))
                             for _ in range(400))
               for c in CATEGORIES for p, (m, _) in PARTITIONS.items()}
    return Workload.from_plan_rows(rows, {p: c for p, (_, c) in PARTITIONS.items()}, lengths)


def speculative(speed: DecodeSpeed) -> DecodeSpeed:
    """Each verify step costs SPEC_STEP_COST plain steps and yields SPEC_ACCEPT tokens."""
    gain = SPEC_ACCEPT / SPEC_STEP_COST
    return DecodeSpeed(tuple((b, r * gain) for b, r in speed.points), speed.prefill_tok_s,
                       f"{speed.source}, × {gain:.2f} (speculative)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    profile = load_profile(PROFILE)
    facts = memory_facts(profile)
    assert profile.speed is not None
    base_speed = DecodeSpeed(tuple(profile.speed.points), None, profile.speed.source or "")
    w = workload(args.samples, args.seed)
    results = []
    for row in ROWS:
        kv = predict_profile(profile, facts, fraction=row.fraction, layout=row.layout,
                             kv_cache_dtype="bfloat16")
        speed = speculative(base_speed) if row.speculative else base_speed
        server = ServerCapacity(kv_tokens=kv.kv_tokens, speed=speed,
                                max_running=row.max_running)
        p = predict(server, w, seed=args.seed)
        results.append((row, kv.kv_tokens, p))
    anchor = results[0][2].duration_s
    print("# assumptions:")
    for line in [*facts.sources(), f"decode speed: {base_speed.source}",
                 f"job: {args.samples:,} samples, {LONG_SHARE:.0%} long; prompts ~"
                 f"{PROMPT_TOKENS['short']}/{PROMPT_TOKENS['long']} tokens; answers "
                 f"exponential, mean {MEAN_ANSWER:,}, capped at max_tokens",
                 f"speculative: acceptance {SPEC_ACCEPT} tokens a verify step, step cost "
                 f"×{SPEC_STEP_COST} (an assumption: measure with the GPU script)",
                 "step time depends only on the running requests (extrapolated past 150)"]:
        print(f"#   {line}")
    sep = " | " if args.markdown else "  "
    head = ["configuration", "KV tokens", "running", "tok/s", "job", "vs anchor"]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print(sep.join(head))
    for row, kv_tokens, p in results:
        cells = [row.name, f"{kv_tokens:,}", f"{p.mean_running:.0f}", f"{p.tok_s:,.0f}",
                 format_duration(p.duration_s), f"{p.duration_s / anchor:.2f}x"]
        print(("| " + sep.join(cells) + " |") if args.markdown else sep.join(cells))


if __name__ == "__main__":
    main()

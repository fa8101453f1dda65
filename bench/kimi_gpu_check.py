"""Measure each row of the Kimi table on the real machine: the day an 8-GPU node with SGLang
and the checkpoint is lent, one command checks what `bench/kimi_case.py` predicts.

    python bench/kimi_gpu_check.py --model-path /models/Kimi-K2.5 [--rows anchor,dcp8,...]

For each row it writes the example profile with that row's levers (`tune.levers.apply_levers`,
the same code `draftgen tune` launches with), launches and verifies it (`draftgen serve`:
the KV tokens the server itself reports), calibrates decode speed at the job's concurrency
levels (`draftgen.planning.calibrate`, real requests), stops it, and prints measured KV
tokens and tok/s beside the memory model's prediction. Nothing is assumed here; a row the
engine refuses says so and the next one runs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftgen.errors import DraftgenError  # noqa: E402
from draftgen.planning.calibrate import calibrate  # noqa: E402
from draftgen.servers import launch, load_profile, stop  # noqa: E402
from draftgen.servers.prediction import memory_facts, predict_profile  # noqa: E402
from draftgen.servers.tune_section import Levers  # noqa: E402
from draftgen.tune.levers import apply_levers  # noqa: E402

PROFILE = ROOT / "examples" / "profiles" / "kimi-k2.5-sglang-8gpu.yaml"
PLAIN = {"dp_attention": False, "dcp": 1}
ROWS: dict[str, Levers] = {
    "anchor": Levers(dp_attention=False, hicache_gb_per_rank=64),
    "frac90": Levers(dp_attention=False, mem_fraction=0.90),
    "frac92": Levers(dp_attention=False, mem_fraction=0.92),
    "dpa8": Levers(dp_attention=True),
    "dcp8": Levers(dcp=8),
    "dcp8_frac92": Levers(dcp=8, mem_fraction=0.92),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--levels", default="32,64,128,182")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    data = yaml.safe_load(PROFILE.read_text())
    data["model_path"] = args.model_path
    data["memory"]["model_config"] = str(ROOT / "examples" / "models" / "kimi-k2.5")
    folder = Path(tempfile.mkdtemp(prefix="kimi-check-"))
    path = folder / "kimi.yaml"
    path.write_text(yaml.safe_dump(data))
    reference = load_profile(path)
    facts = memory_facts(reference)
    levels = [int(x) for x in args.levels.split(",")]
    print("row  predicted_kv  measured_kv  " + "  ".join(f"tok/s@{n}" for n in levels))
    for name in args.rows.split(","):
        profile = apply_levers(reference, ROWS[name])
        predicted = predict_profile(profile, facts).kv_tokens
        try:
            verified = launch(profile, timeout_s=args.timeout)
        except DraftgenError as e:
            print(f"{name}  {predicted:,}  refused or failed: {str(e)[:300]}")
            continue
        try:
            measured = asyncio.run(calibrate(verified.handle.url, profile.served_name or "",
                                             concurrency_levels=levels, max_tokens=1024,
                                             seconds=60, warmup_s=20, prefill=False))
            speeds = "  ".join(f"{tok:,.0f}" for _, tok in measured.speed.points) \
                if measured.speed else "?"
            print(f"{name}  {predicted:,}  {verified.info.kv_tokens or 0:,}  {speeds}",
                  flush=True)
        finally:
            stop(profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

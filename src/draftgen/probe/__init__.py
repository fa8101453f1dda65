"""The A/B probe: does a candidate server configuration (fp8 KV, say) generate what the
reference does? `servers.py` scores on each engine, `distance.py` the
distances, `drift.py` the prefill measure, `gate.py` the decode and cache paths' verdict,
`command.py` runs it over prompts."""

from draftgen.engines.scoring import Position, ProbeError
from draftgen.probe.command import load_prompts, probe_command, run_probe
from draftgen.probe.distance import matching_prefix, topk_kl
from draftgen.probe.drift import (
    ProbeResult,
    ProbeThresholds,
    PromptProbe,
    compare_prompt,
    format_report,
    summarise,
)

__all__ = [
    "Position", "ProbeError", "ProbeResult", "ProbeThresholds", "PromptProbe", "compare_prompt",
    "format_report", "load_prompts", "matching_prefix", "probe_command", "run_probe",
    "summarise", "topk_kl",
]

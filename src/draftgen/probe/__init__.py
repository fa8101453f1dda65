"""The A/B probe: does a candidate server configuration (fp8 KV, say) generate what the
reference does? `servers.py` scores on each engine, `drift.py` measures and judges,
`command.py` runs it over prompts."""

from draftgen.probe.command import load_prompts, probe_command, run_probe
from draftgen.probe.drift import (
    ProbeResult,
    ProbeThresholds,
    PromptProbe,
    compare_prompt,
    format_report,
    matching_prefix,
    summarise,
    topk_kl,
)
from draftgen.servers.engines.scoring import Position, ProbeError

__all__ = [
    "Position", "ProbeError", "ProbeResult", "ProbeThresholds", "PromptProbe", "compare_prompt",
    "format_report", "load_prompts", "matching_prefix", "probe_command", "run_probe",
    "summarise", "topk_kl",
]

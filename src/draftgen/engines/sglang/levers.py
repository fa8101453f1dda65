"""The tune's levers as SGLang spells them.

    chunked_prefill   --chunked-prefill-size N (the TP group's; DP-attention ranks divide it)
    prefix_cache      on by default; --disable-radix-cache turns it off
    speculative       --speculative-algorithm A --speculative-draft-model-path P
                      --speculative-num-steps --speculative-eagle-topk
                      --speculative-num-draft-tokens
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from draftgen.engines.common import drop_flag

if TYPE_CHECKING:
    from draftgen.engines.spec import DraftSpec, LaunchSpec

CHUNK_FLAG = "--chunked-prefill-size"
NO_RADIX = "--disable-radix-cache"
SPECULATIVE_FLAGS = (
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens",
)  # fmt: skip


def prefix_cache_on(args: Sequence[str]) -> bool:
    return NO_RADIX not in args


def with_prefix_cache(args: Sequence[str], on: bool) -> list[str]:
    kept = drop_flag(args, NO_RADIX, valued=False)
    return kept if on else [*kept, NO_RADIX]


def adaptive_problem(profile: LaunchSpec) -> str | None:
    """Where 0.5.23 turns --speculative-adaptive off with only a warning
    (`speculative/adaptive_spec_params.py` adaptive_unsupported_reason)."""
    spec = profile.tune.speculative if profile.tune else None
    if spec is not None and spec.method.upper() not in ("EAGLE", "EAGLE3"):
        return f"SGLang adapts only EAGLE/EAGLE3 drafts, not {spec.method}"
    if spec is not None and (spec.eagle_topk or 1) != 1:
        return "SGLang adapts only drafts with eagle_topk 1"
    if profile.dp_attention:
        return "SGLang turns adaptive speculative decoding off under DP attention"
    return None


def speculative_args(spec: DraftSpec) -> list[str]:
    args = ["--speculative-algorithm", spec.method]
    if spec.draft_model:
        args += ["--speculative-draft-model-path", spec.draft_model]
    steps = spec.num_steps or max(1, spec.num_tokens - 1)
    return [*args, "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(spec.eagle_topk or 1),
            "--speculative-num-draft-tokens", str(spec.num_tokens)]

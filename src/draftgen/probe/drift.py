"""The A/B probe's measure: how far a candidate server configuration (fp8 KV, say) drifts
from a reference.

Both servers serve the same model. For each prompt:

1. The chat prompt is rendered to token ids once, by the reference (vLLM `/tokenize`;
   SGLang's chat endpoint with `return_prompt_token_ids`), so both servers see the same ids.
2. The reference continues it greedily (`max_tokens`, temperature 0, penalties off).
3. Both servers score prompt + that continuation by teacher forcing — vLLM `/v1/completions`
   with `prompt_logprobs`, SGLang `/generate` with `max_new_tokens: 0` and
   `logprob_start_len` — returning, per continuation position, the forced token's
   log-probability and the top-k. The reference is scored the same way as the candidate so
   the two distributions come from the same code path at the same positions.
4. The candidate also continues the prompt greedily; its tokens are compared with the
   reference's (matching prefix, first divergence, exact match).

Tokens are identified by id everywhere; token strings are ambiguous (byte fragments decode to
"" or U+FFFD).

The KL estimator over top-k cells is `distance.topk_kl`.

Caveat: teacher forcing is one prefill. Engines whose prefill attends to the freshly
computed K/V without going through the quantised cache (SGLang's ragged extend kernels)
show less KV-quantisation drift in this score than in decoding; vLLM reads attention from
the cache in prefill too. The greedy-divergence numbers come from real decoding on both
servers and see the KV cache as generation does.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from draftgen.engines.scoring import Position
from draftgen.probe.distance import is_argmax, matching_prefix, topk_kl
from draftgen.probe.gate import GateResult


@dataclass(frozen=True, slots=True)
class ProbeThresholds:
    """Verdict limits. Starting points for a real model; calibrate them by probing the
    reference against itself (or a twin server), which shows the noise floor."""

    max_mean_kl: float = 0.01  # nats per position
    min_top1: float = 0.97  # share of positions where the two servers' argmax agree
    min_exact_match: float | None = None  # share of identical greedy continuations


@dataclass(frozen=True, slots=True)
class PromptProbe:
    index: int
    prompt_tokens: int
    tokens: int  # length of the reference's greedy continuation
    kls: tuple[float, ...]  # per continuation position
    top1_hits: int  # positions where the candidate's argmax is (one of) the reference's
    reference_top1_hits: int  # positions where the reference's greedy token is its argmax
    matching_prefix: int  # leading tokens the two greedy continuations share
    exact_match: bool

    @property
    def first_divergence(self) -> int | None:
        return None if self.exact_match else self.matching_prefix

    @property
    def mean_kl(self) -> float:
        return statistics.fmean(self.kls) if self.kls else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "index": self.index, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
            "mean_kl": self.mean_kl, "max_kl": max(self.kls, default=0.0),
            "top1_agreement": self.top1_hits / len(self.kls) if self.kls else 1.0,
            "matching_prefix": self.matching_prefix, "exact_match": self.exact_match,
            "first_divergence": self.first_divergence,
        }


@dataclass(frozen=True)
class ProbeResult:
    reference: str
    candidate: str
    engines: tuple[str, str]
    model: str | None
    max_tokens: int
    top_k: int
    thresholds: ProbeThresholds
    details: tuple[PromptProbe, ...]
    positions: int
    mean_kl: float
    p95_kl: float
    max_kl: float
    # The candidate's teacher-forced argmax against the reference's, at the same positions by
    # the same code path, ties counting as agreement. Against the reference's greedy tokens
    # instead, the reference's own prefill-vs-decode differences would count as drift.
    top1_agreement: float
    # The reference's greedy tokens against its own teacher-forced argmax: the noise floor
    # of the greedy comparison (below 1 with batch-variant or prefill/decode differences).
    reference_top1: float
    exact_match_rate: float
    mean_matching_prefix: float
    median_first_divergence: float | None  # over prompts that diverged
    mean_first_divergence: float | None
    failures: tuple[str, ...] = field(default=())
    # The decode and cache-read paths against the reference's own noise (`gate.py`).
    gate: GateResult | None = None

    @property
    def passed(self) -> bool:
        return not self.failures and (self.gate is None or self.gate.passed)

    def verdict_line(self) -> str:
        head = "PASS" if self.passed else "FAIL"
        stats = (
            f"mean KL {self.mean_kl:.2e} nats, top-1 {self.top1_agreement:.2%}, "
            f"exact match {self.exact_match_rate:.0%} ({len(self.details)} prompts, "
            f"{self.positions} positions)"
        )
        reasons = [*self.failures, *(self.gate.failures if self.gate else ())]
        return f"{head}: {stats}" + (f" — {'; '.join(reasons)}" if reasons else "")

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k not in ("details", "gate")}
        data["passed"] = self.passed
        data["details"] = [d.summary() for d in self.details]
        data["gate"] = self.gate.to_dict() if self.gate is not None else None
        return data


# --- the per-prompt comparison ----------------------------------------------------------


def compare_prompt(
    index: int,
    prompt_tokens: int,
    ref_out: Sequence[int],
    cand_out: Sequence[int],
    ref_pos: Sequence[Position],
    cand_pos: Sequence[Position],
) -> PromptProbe:
    pairs = list(zip(ref_pos, cand_pos, strict=True))
    return PromptProbe(
        index=index,
        prompt_tokens=prompt_tokens,
        tokens=len(ref_out),
        kls=tuple(topk_kl(r, c) for r, c in pairs),
        top1_hits=sum(is_argmax(r, c.top1) for r, c in pairs),
        reference_top1_hits=sum(is_argmax(r, r.token) for r, _ in pairs),
        matching_prefix=matching_prefix(ref_out, cand_out),
        exact_match=list(ref_out) == list(cand_out),
    )


def summarise(
    reference: str,
    candidate: str,
    engines: tuple[str, str],
    model: str | None,
    max_tokens: int,
    top_k: int,
    thresholds: ProbeThresholds,
    details: tuple[PromptProbe, ...],
) -> ProbeResult:
    """Pool positions over prompts (a long continuation weighs more) and judge."""
    kls = sorted(k for d in details for k in d.kls)
    positions = len(kls)
    diverged = [d.matching_prefix for d in details if not d.exact_match]
    mean_kl = statistics.fmean(kls) if kls else 0.0
    top1 = sum(d.top1_hits for d in details) / positions if positions else 1.0
    exact = sum(d.exact_match for d in details) / len(details) if details else 1.0
    failures = []
    if mean_kl > thresholds.max_mean_kl:
        failures.append(f"mean KL {mean_kl:.2e} > {thresholds.max_mean_kl:g}")
    if top1 < thresholds.min_top1:
        failures.append(f"top-1 agreement {top1:.2%} < {thresholds.min_top1:.2%}")
    if thresholds.min_exact_match is not None and exact < thresholds.min_exact_match:
        failures.append(f"exact match {exact:.0%} < {thresholds.min_exact_match:.0%}")
    if not positions:
        failures.append("no positions were scored (every reference continuation was empty)")
    return ProbeResult(
        reference=reference,
        candidate=candidate,
        engines=engines,
        model=model,
        max_tokens=max_tokens,
        top_k=top_k,
        thresholds=thresholds,
        details=details,
        positions=positions,
        mean_kl=mean_kl,
        p95_kl=kls[min(positions - 1, math.ceil(0.95 * positions) - 1)] if kls else 0.0,
        max_kl=kls[-1] if kls else 0.0,
        top1_agreement=top1,
        reference_top1=(
            sum(d.reference_top1_hits for d in details) / positions if positions else 1.0
        ),
        exact_match_rate=exact,
        mean_matching_prefix=(
            statistics.fmean(d.matching_prefix for d in details) if details else 0.0
        ),
        median_first_divergence=statistics.median(diverged) if diverged else None,
        mean_first_divergence=statistics.fmean(diverged) if diverged else None,
        failures=tuple(failures),
    )


def format_report(result: ProbeResult) -> str:
    """A plain table of the numbers, then the verdict line."""
    t = result.thresholds

    def opt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        ("reference", f"{result.reference} ({result.engines[0]})", ""),
        ("candidate", f"{result.candidate} ({result.engines[1]})", ""),
        ("prompts / positions", f"{len(result.details)} / {result.positions}",
         f"max_tokens {result.max_tokens}, top-k {result.top_k}"),
        ("mean top-k KL (nats)", f"{result.mean_kl:.3e}", f"<= {t.max_mean_kl:g}"),
        ("p95 / max KL", f"{result.p95_kl:.3e} / {result.max_kl:.3e}", ""),
        ("top-1 agreement", f"{result.top1_agreement:.2%}", f">= {t.min_top1:.2%}"),
        ("reference argmax = its greedy", f"{result.reference_top1:.2%}", "noise floor"),
        ("exact-match rate", f"{result.exact_match_rate:.1%}",
         "" if t.min_exact_match is None else f">= {t.min_exact_match:.0%}"),
        ("mean matching prefix", f"{result.mean_matching_prefix:.1f} tokens", ""),
        ("first divergence mean / median",
         f"{opt(result.mean_first_divergence, '.1f')} / "
         f"{opt(result.median_first_divergence, '.1f')}", "over diverging prompts"),
    ]
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    lines = [f"{name:<{width}}  {value:<{vwidth}}  {note}".rstrip() for name, value, note in rows]
    gate = result.gate.lines() if result.gate is not None else ["paths checked: prefill only"]
    return "\n".join([*lines, *gate, result.verdict_line()])

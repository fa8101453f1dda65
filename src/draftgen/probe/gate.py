"""The quality gate: is a candidate different from the reference beyond the reference's own
noise, on the paths a run takes?

`drift.py` teacher-forces the reference's answer in one prefill on each server. A run's
answers come from *decoding*, and on engines whose prefill attends to freshly computed K/V
(SGLang's extend kernels) a lossy KV cache is read only when decoding or when a later request
reuses cached K/V; speculative decoding runs only in decode. So, per prompt:

- **decode path**: each server generates greedily with its per-token top-k (its decode
  step's own distribution); the reference scores the candidate's tokens, and the candidate
  the reference's. The candidate's drift is KL(reference's score ‖ candidate's decode) per
  position (and the reverse, KL(candidate's score ‖ reference's decode)); the noise floor is
  the same measure with the reference against itself, KL(its score ‖ its decode) — prefill
  against decode on one engine, under the same batching — and a second decode of the
  reference shows its batch-to-batch agreement.
- **cache-read path**: the reference's answer is scored in two steps, its first half and
  then the whole, so the second request reads the first half's K/V from the prefix cache;
  the candidate's cached scores against the reference's cached scores, with the floor the
  reference's cached scores against its fresh ones.
- **greedy path**, where the candidate's decode returns no logprobs (some engines under
  speculative decoding): per prompt, the share of the reference's tokens the candidate's
  greedy tokens do not follow (from their first divergence on) and whether they match
  exactly, with the floor the same between the reference's two decodes (its batch-to-batch
  agreement). It takes the decode paths' place in the verdict; no margin applies to the
  share (`kl_margin` is in nats), `top1_margin` to exact matches.

The verdict is a paired test over prompts (positions within a prompt are not independent):
per prompt, the candidate's mean KL minus the floor's (and the floor's top-1 agreement minus
the candidate's); the candidate fails a path where that excess is above `kl_margin`
(`top1_margin`) at the chosen confidence, one-sided, Bonferroni-corrected over the tests
made. The sizing says how many prompts that design needs to detect a mean KL excess of
`detect_kl` at that confidence with 80% power, from the spread the gate just measured.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from draftgen.engines.scoring import Position, ProbeError, ScoringServer
from draftgen.probe.distance import is_argmax, matching_prefix, topk_kl

POWER = 0.8
GREEDY = "greedy (no decode logprobs)"


@dataclass(frozen=True)
class GateSettings:
    confidence: float = 0.99  # of each "different beyond noise" call
    kl_margin: float = 0.0  # mean KL excess over the floor tolerated (nats per position)
    top1_margin: float = 0.0  # top-1 agreement deficit tolerated
    detect_kl: float = 1e-3  # the excess the sizing line aims to detect
    cache_read: bool = True

    def __post_init__(self) -> None:
        if not 0.5 < self.confidence < 1:
            raise ValueError("confidence must be between 0.5 and 1")
        if self.kl_margin < 0 or self.top1_margin < 0 or self.detect_kl <= 0:
            raise ValueError("margins must be >= 0 and detect_kl > 0")


@dataclass(frozen=True)
class PathCheck:
    """One path's paired comparison over prompts."""

    name: str
    candidate_kl: tuple[float, ...]  # per prompt, mean over its positions
    floor_kl: tuple[float, ...]
    candidate_top1: tuple[float, ...]  # per prompt, share of positions agreeing
    floor_top1: tuple[float, ...]
    positions: int

    @property
    def greedy(self) -> bool:
        """The greedy path: its "KL" is the share of tokens not followed, its "top-1" the
        exact-match share."""
        return self.name == GREEDY

    @property
    def excess_kl(self) -> float:
        return _mean([c - f for c, f in zip(self.candidate_kl, self.floor_kl, strict=True)])

    @property
    def top1_deficit(self) -> float:
        return _mean([f - c for c, f in zip(self.candidate_top1, self.floor_top1, strict=True)])

    def summary(self) -> dict[str, Any]:
        if self.greedy:
            return {"path": self.name, "prompts": len(self.candidate_kl),
                    "positions": self.positions,
                    "candidate_not_followed": _mean(list(self.candidate_kl)),
                    "floor_not_followed": _mean(list(self.floor_kl)),
                    "candidate_exact_match": _mean(list(self.candidate_top1)),
                    "floor_exact_match": _mean(list(self.floor_top1)),
                    "excess_not_followed": self.excess_kl,
                    "exact_match_deficit": self.top1_deficit}
        return {"path": self.name, "prompts": len(self.candidate_kl),
                "positions": self.positions,
                "candidate_mean_kl": _mean(list(self.candidate_kl)),
                "floor_mean_kl": _mean(list(self.floor_kl)),
                "candidate_top1": _mean(list(self.candidate_top1)),
                "floor_top1": _mean(list(self.floor_top1)),
                "excess_kl": self.excess_kl, "top1_deficit": self.top1_deficit}


@dataclass(frozen=True)
class GateResult:
    settings: GateSettings
    paths: tuple[PathCheck, ...]
    reference_repeat_match: float  # share of prompts the reference decoded alike twice
    max_tokens: int
    failures: tuple[str, ...] = field(default=())
    prompts_needed: int | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        s = self.settings
        out = [f"paths checked: {', '.join(p.name for p in self.paths)} (and prefill)"]
        for p in self.paths:
            if p.greedy:
                out.append(
                    f"  {p.name}: {_mean(list(p.candidate_kl)):.1%} of the reference's tokens "
                    f"not followed, against its own {_mean(list(p.floor_kl)):.1%} between two "
                    f"decodes; exact match {_mean(list(p.candidate_top1)):.0%} against "
                    f"{_mean(list(p.floor_top1)):.0%}")
                continue
            out.append(
                f"  {p.name}: mean KL {_mean(list(p.candidate_kl)):.2e} against the floor "
                f"{_mean(list(p.floor_kl)):.2e} (excess {p.excess_kl:+.2e}); top-1 "
                f"{_mean(list(p.candidate_top1)):.2%} against {_mean(list(p.floor_top1)):.2%}"
                f" ({len(p.candidate_kl)} prompts, {p.positions} positions)")
        out.append(f"  reference decoded alike twice: {self.reference_repeat_match:.0%} of "
                   "prompts (its batch-to-batch floor)")
        if self.prompts_needed is not None:
            n = len(self.paths[0].candidate_kl) if self.paths else 0
            out.append(f"  to detect a mean KL excess of {s.detect_kl:g} at "
                       f"{s.confidence:.0%} confidence ({POWER:.0%} power): "
                       f"{self.prompts_needed} prompts of {self.max_tokens} tokens "
                       f"(this gate ran {n})")
        head = "gate PASS" if self.passed else "gate FAIL"
        names = ", ".join(p.name for p in self.paths) or "no path"
        out.append(f"{head} on {names}: different beyond the reference's own noise at "
                   f"{s.confidence:.0%} confidence? "
                   + ("no" if self.passed else "yes — " + "; ".join(self.failures)))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "failures": list(self.failures),
                "confidence": self.settings.confidence, "kl_margin": self.settings.kl_margin,
                "top1_margin": self.settings.top1_margin,
                "reference_repeat_match": self.reference_repeat_match,
                "prompts_needed": self.prompts_needed,
                "paths": [p.summary() for p in self.paths]}


@dataclass
class PromptPaths:
    """One prompt's per-path means: (candidate KL, floor KL, candidate top-1, floor top-1,
    positions) per path name, and whether the reference decoded it alike twice."""

    values: dict[str, tuple[float, float, float, float, int]]
    repeat_match: bool


async def gate_prompt(prompt: list[int], ref: ScoringServer, cand: ScoringServer, *,
                      max_tokens: int, top_k: int, cache_read: bool) -> PromptPaths:
    """The decode and cache-read comparisons of one rendered prompt."""
    async with asyncio.TaskGroup() as tg:
        ref_dec = tg.create_task(ref.decode(prompt, max_tokens, top_k))
        cand_dec = tg.create_task(decode_or_none(cand, prompt, max_tokens, top_k))
        ref_again = tg.create_task(ref.decode(prompt, max_tokens, top_k))
    r_dec, c_dec = ref_dec.result(), cand_dec.result()
    r_tokens = [p.token for p in r_dec]
    again = [p.token for p in ref_again.result()]
    if c_dec is None:
        return greedy_path(r_tokens, await cand.greedy(prompt, max_tokens), again)
    c_tokens = [p.token for p in c_dec]
    async with asyncio.TaskGroup() as tg:
        r_scores_c = tg.create_task(ref.score(prompt, c_tokens, top_k))
        r_scores_r = tg.create_task(ref.score(prompt, r_tokens, top_k))
        c_scores_r = tg.create_task(cand.score(prompt, r_tokens, top_k))
    values = {
        "decode": compare_paths(r_scores_c.result(), c_dec, r_scores_r.result(), r_dec),
        "decode, reverse": compare_paths(c_scores_r.result(), r_dec, r_scores_r.result(), r_dec),
    }
    if cache_read and len(r_tokens) >= 4:
        half = len(r_tokens) // 2
        r_cached, c_cached = await asyncio.gather(cached_scores(ref, prompt, r_tokens, top_k),
                                                  cached_scores(cand, prompt, r_tokens, top_k))
        fresh = r_scores_r.result()[half:]
        values["cache read"] = compare_paths(r_cached[half:], c_cached[half:], fresh,
                                        r_cached[half:])
    return PromptPaths(values, again == r_tokens)


async def decode_or_none(server: ScoringServer, prompt: list[int], max_tokens: int,
                         top_k: int) -> list[Position] | None:
    """The server's decode, or None where it answers without logprobs."""
    try:
        return await server.decode(prompt, max_tokens, top_k)
    except ProbeError as e:
        if "logprobs" in str(e):
            return None
        raise


def greedy_path(reference: Sequence[int], candidate: Sequence[int], again: Sequence[int]
                ) -> PromptPaths:
    """The greedy path of one prompt (see the module docstring): the candidate's greedy
    tokens against the reference's, the floor the reference's second decode against its
    first."""
    same = list(again) == list(reference)
    return PromptPaths({GREEDY: (
        _divergence(reference, candidate), float(list(candidate) == list(reference)),
        _divergence(reference, again), float(same), len(reference))}, same)


def _divergence(a: Sequence[int], b: Sequence[int]) -> float:
    """The share of `a` that `b` does not follow before it first parts from it."""
    return 1.0 - matching_prefix(a, b) / len(a) if a else 0.0


async def cached_scores(server: ScoringServer, prompt: list[int], cont: list[int],
                         top_k: int) -> list[Position]:
    """Score `cont` after its first half went through the server once: the second request's
    prefix is a cache hit, so its later positions attend to cached K/V."""
    await server.score(prompt, cont[:len(cont) // 2], top_k)
    return await server.score(prompt, cont, top_k)


def against_recording(ref_scores: Sequence[Position], ref_decode: Sequence[Position],
                      cand_decode: Sequence[Position]) -> tuple[float, float, float, float, int]:
    """The decode path when the reference is a recording (`draftgen tune` runs one server
    at a time): where the candidate's greedy tokens still follow the reference's, it decodes
    from the same context the reference's answer was scored in, so its decode-step
    distribution is compared with that score; the floor is the reference's own decode
    against its score at the same positions."""
    same = 0
    for r, c in zip(ref_scores, cand_decode, strict=False):
        if r.token != c.token:
            break
        same += 1
    # The first diverging position still shares its context: compare it too.
    upto = min(same + 1, len(ref_scores), len(cand_decode), len(ref_decode))
    forced = [Position(r.token, c.top.get(r.token, c.logprob if c.token == r.token
                                          else min(c.top.values(), default=0.0)),
                       c.top1, c.top) for r, c in zip(ref_scores[:upto], cand_decode[:upto],
                                                     strict=True)]
    return compare_paths(ref_scores[:upto], forced, ref_scores[:upto], ref_decode[:upto])


def compare_paths(base: Sequence[Position], other: Sequence[Position],
             floor_base: Sequence[Position], floor_other: Sequence[Position]
             ) -> tuple[float, float, float, float, int]:
    """Mean KL(base ‖ other) and top-1 agreement, and the same for the floor pair."""
    kl = [topk_kl(b, o) for b, o in zip(base, other, strict=True)]
    top1 = [is_argmax(b, o.top1) for b, o in zip(base, other, strict=True)]
    fkl = [topk_kl(b, o) for b, o in zip(floor_base, floor_other, strict=True)]
    ftop1 = [is_argmax(b, o.top1) for b, o in zip(floor_base, floor_other, strict=True)]
    return _mean(kl), _mean(top1, 1.0), _mean(fkl), _mean(ftop1, 1.0), len(kl)


def judge(prompts: Sequence[PromptPaths], settings: GateSettings, max_tokens: int
          ) -> GateResult:
    names = sorted({n for p in prompts for n in p.values}, key=_PATH_ORDER.index)
    paths = []
    for name in names:
        rows = [p.values[name] for p in prompts if name in p.values]
        paths.append(PathCheck(name, tuple(r[0] for r in rows), tuple(r[2] for r in rows),
                               tuple(r[1] for r in rows), tuple(r[3] for r in rows),
                               sum(r[4] for r in rows)))
    tests = 2 * len(paths)
    alpha = (1 - settings.confidence) / max(tests, 1)
    failures = []
    for p in paths:
        kl_diff = [c - f for c, f in zip(p.candidate_kl, p.floor_kl, strict=True)]
        if _above(kl_diff, 0.0 if p.greedy else settings.kl_margin, alpha):
            failures.append(
                f"{p.name}: {p.excess_kl:+.1%} more of the reference's tokens not followed "
                "than between two of its own decodes" if p.greedy else
                f"{p.name}: mean KL {p.excess_kl:+.2e} above the reference's own noise "
                f"(floor {_mean(list(p.floor_kl)):.2e})")
        deficit = [f - c for c, f in zip(p.candidate_top1, p.floor_top1, strict=True)]
        if _above(deficit, settings.top1_margin, alpha):
            what = "exact matches" if p.greedy else "top-1 agreement"
            failures.append(f"{p.name}: {what} {p.top1_deficit:.2%} below the reference's "
                            "own")
    if not paths or not any(p.positions for p in paths):
        failures.append("no positions were compared (every answer was empty)")
    decode = next((p for p in paths if p.name == "decode"), None)
    needed = None
    if decode is not None and len(decode.candidate_kl) >= 2:
        spread = statistics.stdev(c - f for c, f in zip(decode.candidate_kl, decode.floor_kl,
                                                        strict=True))
        z = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(POWER)
        needed = max(2, math.ceil((z * spread / settings.detect_kl) ** 2))
    repeat = _mean([p.repeat_match for p in prompts], 1.0)
    return GateResult(settings, tuple(paths), repeat, max_tokens, tuple(failures), needed)


_PATH_ORDER = ["decode", "decode, reverse", "cache read", GREEDY]


def _above(diffs: Sequence[float], margin: float, alpha: float) -> bool:
    """One-sided: is the mean of `diffs` above `margin` at level `alpha`? (normal
    approximation of the paired test; a spread of zero is a sure answer)."""
    if not diffs:
        return False
    mean = statistics.fmean(diffs)
    if mean <= margin:
        return False
    if len(diffs) < 2:
        return True
    sd = statistics.stdev(diffs)
    if sd == 0:
        return True
    return (mean - margin) / (sd / math.sqrt(len(diffs))) > NormalDist().inv_cdf(1 - alpha)


def _mean(values: Sequence[float] | Sequence[bool], empty: float = 0.0) -> float:
    return statistics.fmean(values) if values else empty

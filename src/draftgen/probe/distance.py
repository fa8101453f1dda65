"""How far one scored position is from another: the probe's distances.

KL estimator. Only the top-k of each distribution is known, plus the forced token. The
vocabulary is split into cells: each token whose log-probability both servers report (the
intersection of the two top-k sets, plus the forced token) is a cell of its own, and
everything else is one "rest" cell holding the remaining mass (1 - the cells' sum) on each
side. KL(reference ‖ candidate) over these cells is computed exactly, with no imputed values
and no renormalisation. Merging tokens into a cell can only lower KL (the log-sum
inequality), so this is a lower bound on the full-vocabulary KL that becomes exact as the
top-k covers the mass; it is never inflated by guessing the tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from draftgen.engines.scoring import Position

# Cells with less mass than this on the reference side add nothing measurable; on the
# candidate side the floor keeps log(0) out when rounding leaves no rest mass.
_MASS_FLOOR = 1e-9


def topk_kl(ref: Position, cand: Position) -> float:
    """KL(ref ‖ cand) over shared cells plus one rest cell (see the module docstring)."""
    if ref.token != cand.token:
        raise ValueError("positions scored different tokens")
    known = {ref.token: (ref.logprob, cand.logprob)}
    for t in ref.top.keys() & cand.top.keys():
        known[t] = (ref.top[t], cand.top[t])
    kl = 0.0
    p_rest = q_rest = 1.0
    for lp, lq in known.values():
        p = math.exp(lp)
        p_rest -= p
        q_rest -= math.exp(lq)
        kl += p * (lp - lq)
    if p_rest > _MASS_FLOOR:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, _MASS_FLOOR)))
    # Rounding in the servers' float32 log-softmax can push a true 0 a hair below.
    return max(kl, 0.0)


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def is_argmax(pos: Position, token: int) -> bool:
    """Whether `token` has the highest log-probability at `pos`, ties included: bf16
    logits tie often enough that which of the tied tokens a sampler or a ranking
    names first is noise, not drift."""
    lp = pos.logprob if token == pos.token else pos.top.get(token)
    return lp is not None and lp >= max(pos.top.values(), default=lp)

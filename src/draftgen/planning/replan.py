"""Run-time adjustments to a plan: what this run sends, beyond what the sources say.

- `escalate`: truncated samples of `truncation: escalate` partitions move to a larger one;
- `fit_context`: prompts that cannot fit the servers' context become rejected rows, and
  those that leave too little room for max_tokens are shortened or set aside;
- `prefix_order`: samples that open alike are sent side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import replace

from draftgen.job import JobSpec
from draftgen.planning.plan import Plan
from draftgen.planning.tokens import CHARS_PER_TOKEN
from draftgen.sample import Rejected, Sample, base_body, body_digest, content_digest, fingerprint
from draftgen.store import LedgerEntry

# The least answer a shortened sample is sent with; below it the sample is set aside.
MIN_ANSWER_TOKENS = 256


def fit_context(plan: Plan, todo: list[Sample], context: int, *,
                counts: Mapping[str, int], keep: Set[str],
                policy: str = "shorten") -> tuple[Plan, list[Sample], int]:
    """Samples whose prompt cannot fit the servers' context become rejected rows, not
    requests; those that fit but leave less than `max_tokens` are shortened to what fits
    (`policy` "shorten", when at least MIN_ANSWER_TOKENS are left) or set aside too.

    A prompt's length is the server's own count where `counts` has one, else the plan's:
    exact with the job's tokenizer; an estimate only rejects at twice the context, so a
    rough guess never throws away a prompt the server would have taken. Samples in `keep`
    (already done) are never set aside: a done sample shows what it was sent with. Also
    returns how many samples still to send were shortened.
    """
    exact = plan.token_count_label.startswith("tokenizer")
    rejected = list(plan.rejected)
    # id -> the sample as it is now sent, or None when set aside.
    changed: dict[str, Sample | None] = {}
    shortened = 0
    for s in plan.samples:
        n = counts.get(s.id)
        if n is None and not exact:
            if s.prompt_tokens > 2 * context and s.id not in keep:
                changed[s.id] = None
                rejected.append(_too_long(s, f"{s.prompt_tokens} prompt tokens (estimated) "
                                             f"> twice the server's context of {context}"))
            continue
        n = s.prompt_tokens if n is None else n
        room = context - n
        if room >= s.max_tokens:
            if n != s.prompt_tokens:
                changed[s.id] = replace(s, prompt_tokens=n)
        elif policy == "shorten" and room >= min(MIN_ANSWER_TOKENS, s.max_tokens):
            changed[s.id] = replace(s, prompt_tokens=n, max_tokens=room)
            shortened += s.id not in keep
        elif s.id in keep:
            changed[s.id] = replace(s, prompt_tokens=n)
        else:
            changed[s.id] = None
            rejected.append(_too_long(s, (
                f"{n} prompt tokens > the server's context of {context}" if room <= 0 else
                f"{n} prompt tokens + max_tokens {s.max_tokens} > the server's context of "
                f"{context}")))
    if not changed:
        return plan, todo, 0

    def apply(samples: list[Sample]) -> list[Sample]:
        out = (changed.get(s.id, s) for s in samples)
        return [s for s in out if s is not None]

    return replace(plan, samples=apply(plan.samples), rejected=rejected), apply(todo), shortened


def _too_long(s: Sample, why: str) -> Rejected:
    src, _, row = s.source.rpartition(":")
    return Rejected(s.category, src, int(row) if row.isdigit() else -1, f"prompt_too_long: {why}")


# What a chat template may add per message beyond the counted text and its fixed allowance
# (role markers, a default system prompt): a tokenizer's count this close to the limit is
# asked of the server, which renders the template.
TEMPLATE_SLACK_PER_MESSAGE = 16


def near_context(samples: list[Sample], context: int, *, exact: bool) -> list[Sample]:
    """Samples whose prompt might leave less than max_tokens of the context: for a
    tokenizer's count (text, no template), every one within the template's slack of it;
    for an estimate, every one whose characters alone would (a token is rarely shorter than
    a character)."""
    if exact:
        return [s for s in samples if s.prompt_tokens + s.max_tokens + TEMPLATE_SLACK_PER_MESSAGE
                * (len(s.messages) + len(s.followups)) > context]
    return [s for s in samples if s.prompt_tokens * CHARS_PER_TOKEN + s.max_tokens > context]


def escalate(plan: Plan, job: JobSpec, entries: Mapping[str, LedgerEntry], *,
             rerun: bool) -> tuple[Plan, set[str]]:
    """Samples of `truncation: escalate` partitions move to their `escalate_to` partition
    (its max_tokens, a new fingerprint) when they were recorded truncated and `rerun` is
    asked, or were already escalated by an earlier run. The rest stay as planned.
    Also returns the ids escalated just now, whose new requests replace recorded ones."""
    base = body_digest(base_body(job.model, job.sampling.model_dump()))
    out = []
    now: set[str] = set()
    for s in plan.samples:
        part = job.partitions[s.partition]
        e = entries.get(s.id)
        if part.escalate_to is None or e is None:
            out.append(s)
            continue
        target = job.partitions[part.escalate_to]
        fp = fingerprint(base, content_digest(s.messages, s.followups), target.max_tokens,
                         s.seed)
        if rerun and e.status == "done" and e.truncated and e.fingerprint == s.fingerprint:
            now.add(s.id)
        moved = e.fingerprint == fp or s.id in now
        out.append(replace(s, partition=part.escalate_to, max_tokens=target.max_tokens,
                           fingerprint=fp) if moved else s)
    return replace(plan, samples=out), now


def prefix_order(samples: list[Sample]) -> list[Sample]:
    """Samples that open alike (system prompt, first 512 characters of the first user turn)
    side by side, so a server's prefix cache hits; otherwise plan order is kept."""

    def key(s: Sample) -> tuple[str, str]:
        system = s.messages[0]["content"] if s.messages[0]["role"] == "system" else ""
        first_user = next(m["content"] for m in s.messages if m["role"] == "user")
        return system, first_user[:512]

    return sorted(samples, key=key)

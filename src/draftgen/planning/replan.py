"""Run-time adjustments to a plan: what this run sends, beyond what the sources say.

- `escalate`: truncated samples of `truncation: escalate` partitions move to a larger one;
- `set_aside_too_long`: prompts that cannot fit the servers' context become rejected rows;
- `prefix_order`: samples that open alike are sent side by side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from draftgen.job import JobSpec
from draftgen.planning.plan import Plan
from draftgen.sample import Rejected, Sample, base_body, body_digest, content_digest, fingerprint
from draftgen.store import LedgerEntry


def set_aside_too_long(plan: Plan, todo: list[Sample],
                        context: int) -> tuple[Plan, list[Sample]]:
    """Prompts that cannot fit the servers' context become rejected rows, not requests.

    An estimated count only rejects when it is twice the context, so a rough estimate never
    throws away a prompt the server would have taken; the server's own 400 covers the rest.
    """
    limit = context if plan.token_count_label.startswith("tokenizer") else 2 * context
    too_long = {s.id for s in plan.samples if s.prompt_tokens > limit}
    if not too_long:
        return plan, todo
    rejected = list(plan.rejected)
    for s in plan.samples:
        if s.id in too_long:
            src, _, row = s.source.rpartition(":")
            rejected.append(Rejected(s.category, src, int(row) if row.isdigit() else -1,
                                     f"prompt_too_long: {s.prompt_tokens} prompt tokens > the "
                                     f"server's context of {context}"))
    kept = [s for s in plan.samples if s.id not in too_long]
    return replace(plan, samples=kept, rejected=rejected), [
        s for s in todo if s.id not in too_long]


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
        if rerun and e.status == "done" and e.trunc and e.fp == s.fingerprint:
            now.add(s.id)
        moved = e.fp == fp or s.id in now
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

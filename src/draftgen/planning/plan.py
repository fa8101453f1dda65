"""The plan: every sample a job will send, decided before anything is sent.

Building it is deterministic: the same job file and sources give the same samples, ids,
order and fingerprints on any machine, which is what lets a run resume. Per category:

    read rows -> reject bad ones -> drop exact duplicates (an earlier category keeps its
    copy) -> shuffle with a seed of (job.seed, category) -> keep the first `cap` ->
    count prompt tokens -> choose a partition -> one sample per `samples_per_prompt`
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from draftgen.gcpause import gc_paused
from draftgen.job import Category, JobSpec, Partition
from draftgen.planning.tokens import TokenCounter
from draftgen.sample import Rejected, Sample, base_body, body_digest, content_digest, fingerprint
from draftgen.sources import SourcePrompt, open_source, reason_code

NO_PARTITION = "no_partition"
KEY_HEX_CHARS = 12

SUMMARY_KEYS = (
    "prompts",
    "samples",
    "rejected",
    "duplicates",
    "capped",
    "prompt_tokens",
    "max_output_tokens",
)


@dataclass(slots=True)
class GroupStats:
    """Counts for one (category, partition).

    Rows dropped before routing (rejected, duplicates, capped) cannot be given a partition
    in an `auto` category; they are counted under the partition name "auto".
    """

    category: str
    partition: str
    rows_read: int = 0
    rejected: int = 0
    duplicates: int = 0
    capped: int = 0
    prompts: int = 0
    samples: int = 0
    # Summed over samples: with samples_per_prompt > 1 each copy sends its prompt again.
    prompt_tokens: int = 0
    max_output_tokens: int = 0


@dataclass(slots=True)
class Plan:
    samples: list[Sample]
    rejected: list[Rejected]
    stats: dict[tuple[str, str], GroupStats]
    token_count_label: str
    warnings: list[str] = field(default_factory=list)

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per (category, partition) with something to show, in job order."""
        rows: list[dict[str, Any]] = []
        shown: set[str] = set()
        for st in self.stats.values():
            d = asdict(st)
            if any(d[k] for k in SUMMARY_KEYS):
                rows.append(_summary_row(d))
                shown.add(st.category)
        # A category with an empty source still gets its row of zeros rather than vanish.
        for st in self.stats.values():
            if st.category not in shown:
                rows.append(_summary_row(asdict(st)))
                shown.add(st.category)
        order = {c: i for i, c in enumerate(dict.fromkeys(k[0] for k in self.stats))}
        return sorted(rows, key=lambda r: order[r["category"]])

    def totals(self) -> dict[str, Any]:
        """The summary columns summed over every row, shaped like a summary row."""
        total: dict[str, Any] = {"category": "total", "partition": ""}
        for k in SUMMARY_KEYS:
            total[k] = sum(getattr(st, k) for st in self.stats.values())
        total["rows_read"] = sum(st.rows_read for st in self.stats.values())
        return total

    def rejected_by_reason(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.rejected:
            code = reason_code(r.reason)
            counts[code] = counts.get(code, 0) + 1
        return dict(sorted(counts.items()))


def _summary_row(d: dict[str, Any]) -> dict[str, Any]:
    return {"category": d["category"], "partition": d["partition"]} | {
        k: d[k] for k in SUMMARY_KEYS
    }


def route(partitions: dict[str, Partition], prompt_tokens: int) -> str | None:
    """The partition with the largest `min_prompt_tokens` the prompt reaches; ties go to the
    first in the job file. None when the prompt is shorter than every minimum."""
    best: str | None = None
    for name, p in partitions.items():
        if p.min_prompt_tokens <= prompt_tokens and (
            best is None or p.min_prompt_tokens > partitions[best].min_prompt_tokens
        ):
            best = name
    return best


def build_plan(job: JobSpec, counter: TokenCounter | None = None) -> Plan:
    """Read every category's source and expand it into samples; see the module docstring."""
    counter = counter if counter is not None else TokenCounter.from_job(job)
    plan = Plan(samples=[], rejected=[], stats={}, token_count_label=counter.label)
    if counter.warning:
        plan.warnings.append(counter.warning)
    base = body_digest(base_body(job.model, job.sampling.model_dump()))
    seen: set[str] = set()
    with gc_paused():
        for category in job.categories:
            _plan_category(job, category, counter, base, seen, plan)
    # Job order for the summary, whatever order shuffled prompts reached their partitions in.
    rank = {name: i for i, name in enumerate(["auto", *job.partitions])}
    cats = {c.name: i for i, c in enumerate(job.categories)}
    plan.stats = dict(sorted(plan.stats.items(), key=lambda kv: (cats[kv[0][0]], rank[kv[0][1]])))
    return plan


def _stats(plan: Plan, category: str, partition: str) -> GroupStats:
    key = (category, partition)
    if key not in plan.stats:
        plan.stats[key] = GroupStats(category, partition)
    return plan.stats[key]


def _plan_category(
    job: JobSpec,
    category: Category,
    counter: TokenCounter,
    base: str,
    seen: set[str],
    plan: Plan,
) -> None:
    reader = open_source(category.source, job.resolve("."))
    pre = _stats(plan, category.name, category.partition)
    kept: list[tuple[SourcePrompt, str]] = []
    for item in reader.read(category.name, job.multi_turn, category.system_prompt):
        pre.rows_read += 1
        if isinstance(item, Rejected):
            plan.rejected.append(item)
            pre.rejected += 1
            continue
        digest = content_digest(item.messages, item.followups)
        if digest in seen:
            pre.duplicates += 1
            continue
        seen.add(digest)
        kept.append((item, digest))

    random.Random(f"{job.seed}:{category.name}").shuffle(kept)
    if category.cap is not None and len(kept) > category.cap:
        pre.capped += len(kept) - category.cap
        del kept[category.cap :]

    counts = counter.count_many([(p.messages, p.followups) for p, _ in kept])
    spp = job.samples_per_prompt
    seed = job.sampling.seed
    keys: set[str] = set()
    for (prompt, digest), tokens in zip(kept, counts, strict=True):
        part = category.partition if category.partition != "auto" else route(job.partitions, tokens)
        if part is None:
            # Found only after capping, so such a category can end below its cap.
            lowest = min(p.min_prompt_tokens for p in job.partitions.values())
            plan.rejected.append(
                Rejected(
                    category=category.name,
                    source=reader.name,
                    row=prompt.row,
                    reason=f"{NO_PARTITION}: {tokens} prompt tokens is below every "
                    f"partition's min_prompt_tokens (lowest {lowest})",
                )
            )
            pre.rejected += 1
            continue
        key = prompt.id if prompt.id is not None else digest[:KEY_HEX_CHARS]
        if key in keys:
            # Two different prompts sharing a 12-hex prefix: vanishingly rare, but an id
            # must never name two samples, so the later one takes the whole digest.
            key = digest
        keys.add(key)
        max_tokens = job.partitions[part].max_tokens
        st = _stats(plan, category.name, part)
        st.prompts += 1
        for k in range(spp):
            sample_seed = seed + k if seed is not None else None
            plan.samples.append(Sample(
                id=f"{category.name}-{key}-{k}" if spp > 1 else f"{category.name}-{key}",
                category=category.name,
                partition=part,
                messages=prompt.messages,
                max_tokens=max_tokens,
                followups=prompt.followups,
                seed=sample_seed,
                prompt_tokens=tokens,
                source=f"{reader.name}:{prompt.row}",
                fingerprint=fingerprint(base, digest, max_tokens, sample_seed),
                source_id=(None if prompt.id is None
                           else f"{prompt.id}-{k}" if spp > 1 else str(prompt.id)),
            ))
        st.samples += spp
        st.prompt_tokens += tokens * spp
        st.max_output_tokens += max_tokens * spp

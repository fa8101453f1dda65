"""The plan: every sample a job will send, decided before anything is sent.

Building it is deterministic: the same job file and sources give the same samples, ids,
order and fingerprints on any machine, which is what lets a run resume. Per category:

    read rows -> reject bad ones -> drop exact duplicates (of an earlier row of the category,
    or of a prompt an earlier category planned) -> shuffle with a seed of (job.seed,
    category) -> keep the first `cap` -> count prompt tokens -> choose a partition ->
    one sample per `samples_per_prompt`

A prompt is only ever dropped as a duplicate of a copy that is planned: one that an earlier
category capped out, or found below every partition's minimum, stays free for a later one.
Sample ids are `<category>-<source id or 12-hex content digest>[-<k>]`; one that would
repeat an id already planned (`a` + `b-1` and `a-b` + `1`) takes the prompt's content
digest too, and the plan warns. A category that ends with no samples is warned about.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from draftgen.gcpause import gc_paused
from draftgen.job import Category, JobSpec, Partition
from draftgen.planning.tokens import TokenCounter
from draftgen.sample import Rejected, Sample, base_body, body_digest, content_digest, fingerprint
from draftgen.sources import SourcePrompt, open_source, reason_code

NO_PARTITION = "no_partition"
KEY_HEX_CHARS = 12
# How many renamed ids the warning names; it counts them all.
RENAMED_SHOWN = 3

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


@dataclass(slots=True)
class _Planned:
    """What the categories planned so far hold, which a later one must not repeat."""

    # Content digests of planned prompts: a later copy of one is a duplicate.
    digests: set[str] = field(default_factory=set)
    # Every sample id planned.
    ids: set[str] = field(default_factory=set)
    # How many prompts' natural ids were already taken, and the first few, described.
    renamed: int = 0
    shown: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Dropped:
    """Why one category's rows did not become prompts, for its warning when none did."""

    rejected: dict[str, int] = field(default_factory=dict)  # reading rejections, by code
    repeated: int = 0  # duplicates of an earlier row of the same category
    earlier: int = 0  # duplicates of a prompt an earlier category planned
    capped: int = 0
    no_partition: int = 0


def build_plan(job: JobSpec, counter: TokenCounter | None = None) -> Plan:
    """Read every category's source and expand it into samples; see the module docstring."""
    counter = counter if counter is not None else TokenCounter.from_job(job)
    plan = Plan(samples=[], rejected=[], stats={}, token_count_label=counter.label)
    if counter.warning:
        plan.warnings.append(counter.warning)
    base = body_digest(base_body(job.model, job.sampling.model_dump()))
    planned = _Planned()
    with gc_paused():
        for category in job.categories:
            _plan_category(job, category, counter, base, planned, plan)
    if planned.renamed:
        n = planned.renamed
        more = f"; and {n - len(planned.shown)} more" if n > len(planned.shown) else ""
        plan.warnings.append(
            f"{n} prompt(s) would have reused a sample id already planned and were given "
            "their content digest to keep ids unique: " + "; ".join(planned.shown) + more
        )
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
    planned: _Planned,
    plan: Plan,
) -> None:
    reader = open_source(category.source, job.resolve("."))
    pre = _stats(plan, category.name, category.partition)
    dropped = _Dropped()
    kept: list[tuple[SourcePrompt, str]] = []
    mine: set[str] = set()
    for item in reader.read(category.name, job.multi_turn, category.system_prompt):
        pre.rows_read += 1
        if isinstance(item, Rejected):
            plan.rejected.append(item)
            pre.rejected += 1
            code = reason_code(item.reason)
            dropped.rejected[code] = dropped.rejected.get(code, 0) + 1
            continue
        digest = content_digest(item.messages, item.followups)
        # Before the cap, so a cap counts distinct prompts. `planned.digests` holds only the
        # prompts earlier categories kept: one they capped out is still this category's.
        if digest in mine or digest in planned.digests:
            pre.duplicates += 1
            if digest in mine:
                dropped.repeated += 1
            else:
                dropped.earlier += 1
            continue
        mine.add(digest)
        kept.append((item, digest))

    random.Random(f"{job.seed}:{category.name}").shuffle(kept)
    if category.cap is not None and len(kept) > category.cap:
        dropped.capped = len(kept) - category.cap
        pre.capped += dropped.capped
        del kept[category.cap :]

    counts = counter.count_many([(p.messages, p.followups) for p, _ in kept])
    spp = job.samples_per_prompt
    seed = job.sampling.seed
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
            dropped.no_partition += 1
            continue
        planned.digests.add(digest)
        source = f"{reader.name}:{prompt.row}"
        ids = _sample_ids(planned, plan, category.name, prompt.id, digest, spp, source)
        max_tokens = job.partitions[part].max_tokens
        st = _stats(plan, category.name, part)
        st.prompts += 1
        for k, sample_id in enumerate(ids):
            sample_seed = seed + k if seed is not None else None
            plan.samples.append(Sample(
                id=sample_id,
                category=category.name,
                partition=part,
                messages=prompt.messages,
                max_tokens=max_tokens,
                followups=prompt.followups,
                seed=sample_seed,
                prompt_tokens=tokens,
                source=source,
                fingerprint=fingerprint(base, digest, max_tokens, sample_seed),
                source_id=(None if prompt.id is None
                           else f"{prompt.id}-{k}" if spp > 1 else str(prompt.id)),
            ))
        st.samples += spp
        st.prompt_tokens += tokens * spp
        st.max_output_tokens += max_tokens * spp
    if dropped.no_partition == len(kept):  # not one prompt planned
        _warn_empty(plan, category, reader.name, pre.rows_read, dropped)


def _candidate_keys(prompt_id: str | None, digest: str) -> Iterator[str]:
    """A prompt's id keys, its natural one first; each later one is less likely taken."""
    if prompt_id is None:
        yield digest[:KEY_HEX_CHARS]
        # Two different prompts sharing a 12-hex prefix: vanishingly rare, but an id must
        # never name two samples, so the later one takes the whole digest.
        stem = digest
    else:
        yield prompt_id
        yield f"{prompt_id}-{digest[:KEY_HEX_CHARS]}"
        stem = f"{prompt_id}-{digest}"
    yield stem
    # Only ids crafted to collide get this far; a counter still ends the search.
    for n in itertools.count(1):
        yield f"{stem}-{n}"


def _sample_ids(
    planned: _Planned,
    plan: Plan,
    category: str,
    prompt_id: str | None,
    digest: str,
    spp: int,
    source: str,
) -> list[str]:
    """The ids of one prompt's samples, none of them an id the plan already holds.

    The first free key in `_candidate_keys` wins, so an id that collides with nothing is
    the same as it always was, and the whole plan gets the same ids on every build.
    """
    key = prompt_id if prompt_id is not None else digest[:KEY_HEX_CHARS]
    ids = [f"{category}-{key}-{k}" for k in range(spp)] if spp > 1 else [f"{category}-{key}"]
    if planned.ids.isdisjoint(ids):  # nearly always: the natural ids, without the search
        planned.ids.update(ids)
        return ids
    clash: tuple[int, str] | None = None  # the first natural id taken, and its place
    for key in _candidate_keys(prompt_id, digest):
        ids = [f"{category}-{key}-{k}" for k in range(spp)] if spp > 1 else [f"{category}-{key}"]
        if planned.ids.isdisjoint(ids):
            planned.ids.update(ids)
            if clash is not None:
                _renamed(planned, plan, clash[1], ids[clash[0]], category, source)
            return ids
        clash = clash or next((j, i) for j, i in enumerate(ids) if i in planned.ids)
    raise AssertionError("unreachable: _candidate_keys never ends")


def _renamed(planned: _Planned, plan: Plan, old: str, new: str, category: str, source: str) -> None:
    planned.renamed += 1
    if len(planned.shown) < RENAMED_SHOWN:
        # Rare, and only the first few: a scan beats an index kept for every sample.
        owner = next(s for s in plan.samples if s.id == old)
        planned.shown.append(
            f"{old!r} of category {category} ({source}) is already category "
            f"{owner.category}'s ({owner.source}): it is now {new!r}"
        )


def _warn_empty(
    plan: Plan, category: Category, source: str, rows: int, dropped: _Dropped
) -> None:
    """A category that plans no sample says why, unless its cap asked for none."""
    name = category.name
    if category.cap == 0:
        return
    if rows == 0:
        plan.warnings.append(f"category {name}: source {source} gave no rows")
        return
    rejected = sum(dropped.rejected.values())
    most_first = sorted(dropped.rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    by_code = ", ".join(f"{code} {n}" for code, n in most_first)
    if rejected == rows:
        plan.warnings.append(
            f"category {name}: all {rows} rows of {source} were rejected ({by_code})"
        )
        return
    parts = [
        f"{rejected} rejected ({by_code})" if rejected else "",
        f"{dropped.repeated} repeated an earlier row" if dropped.repeated else "",
        f"{dropped.earlier} duplicated prompts earlier categories planned"
        if dropped.earlier else "",
        f"{dropped.capped} capped" if dropped.capped else "",
        f"{dropped.no_partition} below every partition's min_prompt_tokens"
        if dropped.no_partition else "",
    ]
    plan.warnings.append(
        f"category {name}: no samples from the {rows} rows of {source}: "
        + ", ".join(p for p in parts if p)
    )

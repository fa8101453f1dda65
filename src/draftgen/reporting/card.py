"""The dataset card: a Markdown report of what a run directory holds and how it was made.

Counts come from the ledger; lengths, system prompts and servers from the stored records,
read once in shard order; the recipe (model, sampling, servers) from the manifest. The
card is what lets someone else reproduce the data, or decide not to train on it.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from draftgen import __version__
from draftgen.quality.checks import (
    ALL_FLAGS,
    TRAINER_GAPS,
    TRUNCATION_FLAGS,
    check_turns,
    quality_flags,
    trainer_gaps,
)
from draftgen.reporting.status import describe_configuration
from draftgen.store.atomic import write_atomic
from draftgen.store.ledger import LedgerEntry
from draftgen.store.reading import (
    UNVERIFIED,
    RejectedCounts,
    count_rejected,
    current_entries,
    seeds_ignored_note,
)
from draftgen.store.run_store import read_manifest
from draftgen.store.shards import read_at
from draftgen.store.tally import CategoryTally, current, tally

CARD_NAME = "DATASET_CARD.md"
# SpecForge's default --max-length.
DEFAULT_MAX_LENGTH = 2048
# System prompts longer than this are shown cut, with their full length and hash.
PROMPT_SHOWN_CHARS = 1500


@dataclass(slots=True)
class CategoryFacts(CategoryTally):
    flagged: int = 0
    # Output tokens of each done sample.
    lengths: list[int] = field(default_factory=list)
    flags: Counter[str] = field(default_factory=Counter)
    # Done samples whose prompt + output exceed max_length.
    too_long: int = 0
    # System prompt text (None: no system message) -> samples that sent it.
    system_prompts: Counter[str | None] = field(default_factory=Counter)


@dataclass(slots=True)
class CardFacts:
    out_dir: Path
    manifest: dict[str, Any]
    max_length: int
    categories: dict[str, CategoryFacts] = field(default_factory=dict)
    servers: Counter[str] = field(default_factory=Counter)
    configurations: Counter[str] = field(default_factory=Counter)
    # Done samples SpecForge's conversation path would train on beyond the target's output.
    trainer_gaps: Counter[str] = field(default_factory=Counter)
    # Done samples whose every turn carries the server's own token ids.
    server_ids: int = 0
    # Done samples with reasoning; of them, with reasoning on a turn before the last one.
    reasoning: int = 0
    earlier_reasoning: int = 0
    rejected: RejectedCounts = field(default_factory=RejectedCounts)

    def total(self, name: str) -> int:
        return sum(getattr(c, name) for c in self.categories.values())


def write_card(out_dir: Path, *, max_length: int = DEFAULT_MAX_LENGTH,
               now: float | None = None) -> Path:
    """Write OUT/DATASET_CARD.md (replacing it) and return its path."""
    path = out_dir / CARD_NAME
    text = render_card(collect(out_dir, max_length=max_length), now=now)
    write_atomic(path, text.encode())
    return path


def collect(out_dir: Path, *, max_length: int = DEFAULT_MAX_LENGTH) -> CardFacts:
    plan, entries = current_entries(out_dir)
    facts = CardFacts(out_dir, read_manifest(out_dir), max_length)
    counted = tally(current(plan, entries), CategoryFacts)
    facts.categories = counted.categories
    for category, e in counted.done:
        facts.categories[category].lengths.append(e.output_tokens)
    for category, e, rec in _records(out_dir, counted.done):
        cat = facts.categories[category]
        turns = rec.get("turns") or []
        flags = e.flags if e.flags is not None else list(check_turns(turns))
        cat.flags.update(flags)
        cat.flagged += bool(quality_flags(flags))
        if turns and _conversation_tokens(turns[-1]) > max_length:
            cat.too_long += 1
        msgs = rec.get("messages") or []
        system = msgs[0]["content"] if msgs and msgs[0].get("role") == "system" else None
        cat.system_prompts[system] += 1
        facts.trainer_gaps.update(trainer_gaps(rec))
        facts.server_ids += bool(turns) and all(t.get("token_ids") is not None for t in turns)
        facts.reasoning += any(t.get("reasoning") for t in turns)
        facts.earlier_reasoning += any(t.get("reasoning") for t in turns[:-1])
        facts.servers[str(rec.get("server") or "unknown")] += 1
        facts.configurations[str(rec.get("server_config") or UNVERIFIED)] += 1
    facts.rejected = count_rejected(out_dir)
    return facts


def _records(out_dir: Path, done: list[tuple[str, LedgerEntry]],
             ) -> Iterator[tuple[str, LedgerEntry, Any]]:
    """Each done entry's record, read in shard order (sequential reads, not plan order);
    an entry that names no shard has no record to read (`draftgen.store.tally`)."""
    files: dict[str, BinaryIO] = {}
    stored = [(c, e, e.shard) for c, e in done if e.shard is not None]
    try:
        for category, e, shard in sorted(stored, key=lambda ces: (ces[2], ces[1].offset)):
            yield category, e, read_at(out_dir, shard, e.offset, e.length, files)
    finally:
        for f in files.values():
            f.close()


def _conversation_tokens(last_turn: dict[str, Any]) -> int:
    # The last turn's prompt holds every earlier turn, so this is the whole conversation
    # as the server tokenized it (chat template included).
    return int(last_turn.get("prompt_tokens") or 0) + int(last_turn.get("completion_tokens") or 0)


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of an ascending sequence (q in 0..100)."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _pct(n: int, of: int) -> str:
    return f"{100 * n / of:.1f}%" if of else "–"


def render_card(facts: CardFacts, *, now: float | None = None) -> str:
    m = facts.manifest
    job = m.get("job") or {}
    stamp = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    out: list[str] = [
        f"# Dataset card: {facts.out_dir.name}",
        "",
        f"Written by draftgen {__version__} on {stamp:%Y-%m-%d %H:%M} UTC from "
        f"`{facts.out_dir}`; the data was generated by draftgen "
        f"{m.get('draftgen_version', 'unknown')}.",
        "",
    ]
    out += _counts_section(facts)
    out += _flags_section(facts)
    out += _lengths_section(facts)
    out += _max_length_section(facts)
    out += _recipe_section(job, m)
    out += _servers_section(facts, m)
    out += _training_section(facts)
    out += _system_prompts_section(facts)
    return "\n".join(out).rstrip() + "\n"


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return [*lines, ""]


def _counts_section(f: CardFacts) -> list[str]:
    names = ("total", "done", "failed", "truncated", "flagged", "pending")
    rows: list[list[object]] = [
        [cat, *(getattr(c, n) for n in names), c.output_tokens]
        for cat, c in f.categories.items()
    ]
    rows.append(["**all**", *(f.total(n) for n in names),
                 f.total("output_tokens")])
    done, trunc, flagged = f.total("done"), f.total("truncated"), f.total("flagged")
    in_reasoning = sum(c.flags["truncated_in_reasoning"] for c in f.categories.values())
    return [
        "## Samples", "",
        *_table(["category", *names, "output tokens"], rows),
        f"Truncated (hit max_tokens): {trunc} of {done} done ({_pct(trunc, done)}), "
        f"{in_reasoning} of them inside the reasoning. Flagged by the output checks: "
        f"{flagged} ({_pct(flagged, done)}). Exports leave out truncated and flagged "
        "samples unless asked (`--include-truncated`, `--include-flagged`). "
        f"Source rows set aside: {f.rejected.rows}. Prompts set aside as too long for the "
        f"server's context: {f.rejected.too_long}.",
        "",
    ]


def _flags_section(f: CardFacts) -> list[str]:
    cats = list(f.categories)
    rows = []
    for code in ALL_FLAGS:
        counts = [f.categories[c].flags[code] for c in cats]
        if any(counts):
            label = code + (" (truncation)" if code in TRUNCATION_FLAGS else "")
            rows.append([label, *counts, sum(counts), _pct(sum(counts), f.total("done"))])
    if not rows:
        return ["## Output checks", "", "No sample was flagged.", ""]
    return ["## Output checks", "",
            "Done samples per flag (a sample can carry several):", "",
            *_table(["flag", *cats, "all", "% of done"], rows)]


def _lengths_section(f: CardFacts) -> list[str]:
    rows = []
    every: list[int] = []
    for cat, c in f.categories.items():
        every += c.lengths
        rows.append(_length_row(cat, c.lengths))
    rows.append(_length_row("**all**", every))
    return ["## Output length (tokens per sample)", "",
            *_table(["category", "samples", "min", "p50", "p90", "p99", "max"], rows)]


def _length_row(name: str, values: list[int]) -> list[object]:
    if not values:
        return [name, 0, "–", "–", "–", "–", "–"]
    v = sorted(values)
    return [name, len(v), v[0], percentile(v, 50), percentile(v, 90), percentile(v, 99), v[-1]]


def _max_length_section(f: CardFacts) -> list[str]:
    n, done = f.total("too_long"), f.total("done")
    head = ["## Training length", ""]
    if not n:
        return [*head, f"All {done} done samples fit in max_length={f.max_length} tokens "
                "(prompt + output, as the server counted them).", ""]
    per_cat = ", ".join(f"{cat} {c.too_long}" for cat, c in f.categories.items() if c.too_long)
    return [*head,
            f"> **Warning:** {n} of {done} done samples ({_pct(n, done)}) are longer than "
            f"max_length={f.max_length} tokens (prompt + output, as the server counted "
            "them); a trainer with that limit (SpecForge's default is 2048) would cut them. "
            f"Per category: {per_cat}.", ""]


def _recipe_section(job: dict[str, Any], m: dict[str, Any]) -> list[str]:
    if not job:
        return ["## Model and sampling", "", "The manifest holds no job.", ""]
    sampling = job.get("sampling") or {}
    set_fields = {k: v for k, v in sampling.items() if v not in (None, {}, [])}
    parts = job.get("partitions") or {}
    rows = [[name, p.get("max_tokens"), p.get("concurrency"), p.get("min_prompt_tokens", 0)]
            for name, p in parts.items()]
    plan = m.get("plan") or {}
    return [
        "## Model and sampling", "",
        f"- model: `{job.get('model')}`",
        f"- tokenizer: `{job.get('tokenizer')}`" if job.get("tokenizer") else "- tokenizer: none",
        f"- job file: `{m.get('job_file') or 'unknown'}`",
        f"- samples per prompt: {job.get('samples_per_prompt', 1)}; multi-turn: "
        f"{job.get('multi_turn', 'last')}; seed: {job.get('seed', 0)}",
        *([f"- **{note}**"] if (note := seeds_ignored_note(m)) else []),
        f"- planned samples: {plan.get('samples', '?')}; prompt token counts: "
        f"{plan.get('token_count', '?')}",
        "", "Sampling (sent with every request; unset fields were not sent):", "",
        *_json_block(set_fields),
        *_table(["partition", "max_tokens", "concurrency", "min_prompt_tokens"], rows),
    ]


def _servers_section(f: CardFacts, m: dict[str, Any]) -> list[str]:
    out = ["## Servers and runs", ""]
    runs = m.get("runs") or []
    rows = []
    for i, r in enumerate(runs, 1):
        started = r.get("started_at")
        when = (f"{datetime.fromtimestamp(started, UTC):%Y-%m-%d %H:%M}"
                if isinstance(started, (int, float)) else "?")
        rows.append([i, when, r.get("duration_s", "?"), ", ".join(
            s.get("url", "?") if isinstance(s, dict) else str(s)
            for s in r.get("servers") or []),
                     r.get("sent", "?"), r.get("done", "?"), r.get("failed", "?"),
                     r.get("stopped") or ""])
    if rows:
        out += _table(["run", "started (UTC)", "seconds", "servers", "sent", "done", "failed",
                       "stopped"], rows)
    if f.servers:
        out += ["Done samples per server:", "",
                *_table(["server", "samples"], f.servers.most_common())]
    if f.configurations:
        known = m.get("configurations") or {}
        out += ["Done samples per server configuration (`draftgen run JOB --redo-config ID` "
                "regenerates those of one):", "",
                *_table(["configuration", "what it ran", "samples"],
                        [[cid, describe_configuration(known.get(cid)), n]
                         for cid, n in f.configurations.most_common()])]
    # What the servers reported about themselves (engine, KV dtype, ...), wherever the
    # manifest keeps it.
    info = {k: v for k, v in m.items() if "server" in k and not k.endswith("events") and v}
    for i, r in enumerate(runs, 1):
        info.update({f"run {i} {k}": v for k, v in r.items()
                     if "server" in k and k != "servers" and not k.endswith("events") and v})
    for k, v in info.items():
        out += [f"{k}:", "", *_json_block(v)]
    return out


_GAP_WORDS = {"source_turns": "source assistant turns", "no_system": "no system prompt",
              "truncated": "truncated"}


def _training_section(f: CardFacts) -> list[str]:
    gaps = [f"{f.trainer_gaps[k]} with {_GAP_WORDS[k]}" for k in TRAINER_GAPS
            if f.trainer_gaps[k]]
    return [
        "## Training with SpecForge", "",
        "Exact path: `draftgen export OUT --format tokens` given to SpecForge as "
        "`data.prompts_path` (pre-tokenised: every masked token is one the target "
        "generated). Conversation path (`--format specforge` as `data.train_data_path`): "
        "SpecForge's template masks in its own newline after each end-of-turn token, and "
        + ("for this data also: " + "; ".join(gaps) + " (source turns: set "
           "`train_only_last_turn`; no system prompt: its qwen templates insert one; "
           "truncated: leave them out of the export)." if gaps else
           "nothing else for this data."),
        "",
        f"Token ids: {f.server_ids} of {f.total('done')} done samples carry the server's own "
        "ids, which `--format tokens` exports as they are; the rest are tokenised with the "
        "job's tokenizer and chat template (`metadata.token_source` says which, per row).",
        "",
        *_reasoning_paragraph(f),
    ]


def _reasoning_paragraph(f: CardFacts) -> list[str]:
    earlier = (f" {f.earlier_reasoning} of them have reasoning on a turn before the last user "
               "message, which Qwen3-style templates render without it (as the model saw it "
               "next turn): that reasoning is trained on neither path.")
    return [] if not f.reasoning else [
        f"Reasoning: {f.reasoning} of {f.total('done')} done samples carry the model's "
        "reasoning. For the conversation path export with `--reasoning field` "
        "(`reasoning_content` on every generated turn) and train with a thinking chat "
        "template, `data.chat_template: qwen3-thinking` for Qwen3-style models (`qwen3.5` or "
        "`qwen3-next-thinking` where the generation prompt opens `<think>`; "
        "`kimi-k2-thinking`; `deepseek-v32`), which renders with `enable_thinking=True`; the "
        "rows pass SpecForge's `validate_regenerated_data.py --expect-reasoning "
        "--strict-think-markers`. Its other templates (`qwen`, `llama3`, ...) drop "
        "`reasoning_content`. `--reasoning inline` (the default) writes the reasoning into "
        "`content` as the model's chat template renders it (the job's tokenizer or "
        "`--tokenizer`; else `<think>\\n…\\n</think>\\n\\n`): every template trains it, "
        "but `--strict-think-markers` rejects it. `--format tokens` renders it with the "
        "model's template either way." + (earlier if f.earlier_reasoning else ""), ""]


def _system_prompts_section(f: CardFacts) -> list[str]:
    out = ["## System prompts", "",
           "Exactly as sent, per category (each distinct prompt once).", ""]
    for cat, c in f.categories.items():
        out += [f"### {cat}", ""]
        if not c.system_prompts:
            out += ["No done samples.", ""]
        for text, n in c.system_prompts.most_common():
            if text is None:
                out += [f"- {n} samples: no system message", ""]
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            shown = text if len(text) <= PROMPT_SHOWN_CHARS else (
                text[:PROMPT_SHOWN_CHARS] + f"\n… ({len(text) - PROMPT_SHOWN_CHARS} more chars)")
            out += [f"- {n} samples, {len(text)} chars, sha256 {digest}:", "",
                    *_fenced(shown)]
    return out


def _json_block(value: object) -> list[str]:
    return _fenced(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
                   .decode(), "json")


def _fenced(text: str, lang: str = "") -> list[str]:
    # A fence longer than any backtick run inside, so no prompt can end the block early.
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + lang, text, fence, ""]

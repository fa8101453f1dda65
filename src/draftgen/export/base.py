"""Choosing which records to export, and the bookkeeping every format shares.

A format only turns one record into one row (`Format.row`) and, for binary formats, writes
the rows (`Format.write`); `Format.prepare` sees the run once before the first row. Records
are read in plan order, the latest ledger entry per id, and only where its request
fingerprint still matches the plan. Samples flagged by the output checks are left out
unless asked for; truncation keeps its own rule (`include_truncated`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson

from draftgen.errors import JobError
from draftgen.quality.checks import check_turns, quality_flags
from draftgen.status import current_entries
from draftgen.store.run_store import read_manifest
from draftgen.store.shards import read_at

Reasoning = Literal["inline", "field", "drop"]


@dataclass(frozen=True, slots=True)
class ExportOptions:
    format: str = "specforge"
    reasoning: Reasoning = "inline"
    include_truncated: bool = False
    # Also export samples the output checks flagged (loops, leaked reasoning, ...).
    include_flagged: bool = False
    # The `tokens` format's tokenizer (a local directory or hub name); default: the job's.
    tokenizer: str | None = None


@dataclass(frozen=True, slots=True)
class ExportSummary:
    to: Path
    exported: int
    failed: int
    truncated: int
    empty: int
    pending: int
    flagged: int = 0

    def line(self) -> str:
        return (f"exported {self.exported} samples to {self.to}; left out: {self.failed} failed, "
                f"{self.truncated} truncated, {self.flagged} flagged, {self.empty} empty, "
                f"{self.pending} pending")


@dataclass(frozen=True, slots=True)
class ExportContext:
    """What a format may need beyond one record: the run directory and its manifest."""

    out_dir: Path
    manifest: dict[str, Any]

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The `chat_template_kwargs` every request carried (the thinking switch), if any."""
        job = self.manifest.get("job") or {}
        extra = (job.get("sampling") or {}).get("extra_body") or {}
        kwargs = extra.get("chat_template_kwargs")
        return dict(kwargs) if isinstance(kwargs, dict) and kwargs else None


def conversation(rec: dict[str, Any], reasoning: Reasoning) -> list[dict[str, str]]:
    """Sent messages, then each generated reply, interleaved with the follow-up user turns."""
    msgs = [dict(m) for m in rec["messages"]]
    followups = list(rec.get("followups") or [])
    for i, turn in enumerate(rec["turns"]):
        if i:
            msgs.append({"role": "user", "content": followups[i - 1]})
        content = turn["content"] or ""
        thought = turn.get("reasoning")
        msg = {"role": "assistant", "content": content}
        if thought and reasoning == "inline":
            msg["content"] = f"<think>{thought}</think>{content}"
        elif thought and reasoning == "field":
            msg["reasoning_content"] = thought
        msgs.append(msg)
    return msgs


class Format:
    suffix = ".jsonl"
    ctx: ExportContext

    def prepare(self, ctx: ExportContext, opts: ExportOptions) -> None:
        """Called once before the first row; loads what every row shares."""
        self.ctx = ctx

    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        raise NotImplementedError

    def write(self, rows: Iterator[dict[str, Any]], f: BinaryIO) -> None:
        for r in rows:
            f.write(orjson.dumps(r) + b"\n")


def _formats() -> dict[str, Format]:
    from draftgen.export.parquet import ParquetFormat
    from draftgen.export.sharegpt import ShareGPTFormat
    from draftgen.export.specforge import SpecForgeFormat
    from draftgen.export.tokens import TokensFormat

    return {"specforge": SpecForgeFormat(), "sharegpt": ShareGPTFormat(),
            "parquet": ParquetFormat(), "tokens": TokensFormat()}


def export_run(out_dir: Path, to: Path, opts: ExportOptions) -> ExportSummary:
    formats = _formats()
    fmt = formats.get(opts.format)
    if fmt is None:
        raise JobError(f"--format: {opts.format!r} is not one of {sorted(formats)}")
    plan, entries = current_entries(out_dir)
    manifest = read_manifest(out_dir)
    fmt.prepare(ExportContext(out_dir, manifest), opts)
    # Partitions whose job says `truncation: keep`: their truncated samples are exported,
    # tagged `"truncated": true`.
    keep = {name for name, p in ((manifest.get("job") or {}).get("partitions") or {}).items()
            if p.get("truncation") == "keep"}
    counts = {"failed": 0, "truncated": 0, "empty": 0, "pending": 0, "exported": 0,
              "flagged": 0}
    files: dict[str, BinaryIO] = {}

    def rows() -> Iterator[dict[str, Any]]:
        for p in plan:
            e = entries.get(p["id"])
            if e is None or e.fp != p["fingerprint"]:
                counts["pending"] += 1
            elif e.status != "done" or e.shard is None:
                counts["failed"] += 1
            elif e.trunc and not (opts.include_truncated or e.part in keep):
                counts["truncated"] += 1
            else:
                rec = read_at(out_dir, e.shard, e.off, e.len, files)
                if not all((t["content"] or "").strip() for t in rec["turns"]):
                    counts["empty"] += 1
                    continue
                # Ledgers written before the checks existed carry no flags: check now.
                flags = e.flags if e.flags is not None else check_turns(rec["turns"])
                if quality_flags(flags) and not opts.include_flagged:
                    counts["flagged"] += 1
                    continue
                counts["exported"] += 1
                row = fmt.row(rec, opts)
                if e.trunc:
                    row["truncated"] = True
                yield row

    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_name(f".{to.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            fmt.write(rows(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, to)
    finally:
        for fh in files.values():
            fh.close()
        tmp.unlink(missing_ok=True)
    return ExportSummary(to, counts["exported"], counts["failed"], counts["truncated"],
                         counts["empty"], counts["pending"], counts["flagged"])

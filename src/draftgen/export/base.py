"""What a format writes: its contract and the pieces every format shares.

A format only turns one record into one row (`Format.row`) and, for binary formats, writes
the rows (`Format.write`); `Format.prepare` sees the run once before the first row. Which
records reach it is decided in `run.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson

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
    # "source": each row keeps its source row's own id where it has one and no other row
    # of the export shares it (else draftgen's `category-id`).
    ids: Literal["draftgen", "source"] = "draftgen"
    # "source": rows in the order of their source files and rows, not the plan's.
    order: Literal["plan", "source"] = "plan"


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

    def notes(self) -> list[str]:
        """What the export's summary should say about the rows written (after writing)."""
        return []

    def write(self, rows: Iterator[dict[str, Any]], f: BinaryIO) -> None:
        for r in rows:
            f.write(orjson.dumps(r) + b"\n")

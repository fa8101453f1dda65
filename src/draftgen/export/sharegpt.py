"""ShareGPT JSONL: conversations of {from: system|human|gpt, value}."""

from __future__ import annotations

from typing import Any

from draftgen.export.base import ExportOptions, Format, conversation

_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


class ShareGPTFormat(Format):
    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        conv = conversation(rec, "inline" if opts.reasoning == "field" else opts.reasoning)
        row: dict[str, Any] = {
            "id": rec["id"],
            "conversations": [{"from": _FROM[m["role"]], "value": m["content"]} for m in conv],
        }
        if (kwargs := self.ctx.template_kwargs) is not None:
            row["chat_template_kwargs"] = kwargs
        return row

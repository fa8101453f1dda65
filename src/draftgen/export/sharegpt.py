"""ShareGPT JSONL: conversations of {from: system|human|gpt, value}.

ShareGPT has no reasoning field: `--reasoning field` writes reasoning inline, as `inline`
does (in the model's chat template's style; see `base.Thinking`)."""

from __future__ import annotations

from typing import Any

from draftgen.export.base import ExportContext, ExportOptions, Format, Thinking

_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


class ShareGPTFormat(Format):
    def prepare(self, ctx: ExportContext, opts: ExportOptions) -> None:
        super().prepare(ctx, opts)
        self.thinking = Thinking(ctx, opts, mode="inline" if opts.reasoning == "field"
                                 else opts.reasoning)

    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        conv = self.thinking.conversation(rec)
        row: dict[str, Any] = {
            "id": rec["id"],
            "conversations": [{"from": _FROM[m["role"]], "value": m["content"]} for m in conv],
        }
        if (kwargs := self.ctx.template_kwargs) is not None:
            row["chat_template_kwargs"] = kwargs
        return row

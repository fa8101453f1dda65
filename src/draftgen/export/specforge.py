"""SpecForge JSONL: string id, role/content conversations with the exact system prompt sent."""

from __future__ import annotations

from typing import Any

from draftgen.export.base import ExportOptions, Format, conversation


class SpecForgeFormat(Format):
    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        row = {
            "id": rec["id"],
            "conversations": conversation(rec, opts.reasoning),
            # SpecForge's validator wants this on regenerated rows.
            "status": "success",
        }
        # The thinking switch the answers were made with: training must render the same.
        if (kwargs := self.ctx.template_kwargs) is not None:
            row["chat_template_kwargs"] = kwargs
        return row

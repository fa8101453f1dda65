"""SpecForge JSONL: string id, role/content conversations with the exact system prompt sent.

SpecForge renders these rows through its own chat template and masks every assistant turn
for the loss, so some of what it trains on was not written by the target (measured with
SpecForge 0.2.0's own preparation in tests/conformance/test_specforge_consumer.py): the
source's earlier assistant turns, an end-of-turn token after a truncated answer, a default
system prompt where a row has none, and the template's text after each end token. The
export says how many rows each applies to and what to do; `--format tokens` is the exact
path (SpecForge takes its `input_ids` and `loss_mask` as they are).

Reasoning (read from SpecForge 0.2.0's data/parse.py and template.py): SpecForge renders
rows through the model's own chat template. `--reasoning field` rows keep
`reasoning_content` only under a chat template with `parser_type="thinking"` (e.g.
`qwen3-thinking`), which also renders with `enable_thinking=True`; every other template
drops the field before rendering. `--reasoning inline` rows carry the reasoning in `content`
as the model's template renders it, which any template trains, but SpecForge's
`validate_regenerated_data.py --strict-think-markers` rejects and its
`expand_reasoning_conversations.py` skips (both want `reasoning_content`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from draftgen.export.base import ExportContext, ExportOptions, Format
from draftgen.quality.checks import trainer_gaps

# What SpecForge's own templates do to a row without a system prompt.
_QWEN_SYSTEM = ("SpecForge's qwen-family templates insert 'You are a helpful assistant.', "
                "which the target never saw (use a template without one, such as lfm, or "
                "--format tokens)")

_ADVICE = {
    "source_turns": "carry assistant turns from the source prompt, which SpecForge masks in "
                    "for the loss (set train_only_last_turn for multi_turn: last, or use "
                    "--format tokens)",
    "truncated": "are truncated: SpecForge's template appends an end-of-turn token the model "
                 "never generated and trains on it (leave them out, or use --format tokens)",
    "no_system": "have no system prompt: " + _QWEN_SYSTEM,
}

# What SpecForge does with the reasoning, by --reasoning mode.
_REASONING = {
    "field": "carry reasoning_content, which SpecForge keeps only under a thinking chat "
             "template (data.chat_template qwen3-thinking for Qwen3-style models; qwen3.5, "
             "qwen3-next-thinking, kimi-k2-thinking, deepseek-v32 for theirs): qwen, llama3 "
             "and the rest drop it and train the answer alone",
    "inline": "carry reasoning inline in content, which SpecForge trains under the model's "
              "template family (qwen3-thinking or qwen for Qwen3), but its "
              "validate_regenerated_data.py --strict-think-markers rejects and "
              "expand_reasoning_conversations.py skips (use --reasoning field for those)",
}


class SpecForgeFormat(Format):
    _counts: Counter[str]

    def prepare(self, ctx: ExportContext, opts: ExportOptions) -> None:
        super().prepare(ctx, opts)
        self._counts = Counter()

    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        self._counts.update(trainer_gaps(rec))
        row = {
            "id": rec["id"],
            "conversations": self.thinking.conversation(rec),
            # SpecForge's validator wants this on regenerated rows.
            "status": "success",
        }
        # The thinking switch the answers were made with: training must render the same.
        if (kwargs := self.ctx.template_kwargs) is not None:
            row["chat_template_kwargs"] = kwargs
        return row

    def notes(self) -> list[str]:
        notes = [f"{n} row(s) {self._advice(k)}" for k, n in sorted(self._counts.items()) if n]
        if n := self.thinking.rows:
            notes.append(f"{n} row(s) {_REASONING[self.thinking.mode]}")
        notes += super().notes()
        if self.ctx.template_kwargs is not None:
            notes.append("rows carry chat_template_kwargs, which SpecForge's preparation does "
                         "not apply: set its template to render the same way")
        return notes

    def _advice(self, gap: str) -> str:
        if gap != "no_system" or not self.thinking.template_known:
            return _ADVICE[gap]
        inserted = self.thinking.template_system
        if inserted is None:
            return ("have no system prompt, and the model's chat template writes none: "
                    + _QWEN_SYSTEM)
        return (f"have no system prompt, so the model's own chat template wrote its default "
                f"{inserted!r} and the target answered after it: SpecForge trains them right "
                "only under a template that writes the same (--format tokens carries the "
                "prompt ids the server rendered)")

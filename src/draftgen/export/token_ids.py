"""Token-exact rows: `input_ids` and `loss_mask` (1 on what the model generated).

The ids come from the model's own tokenizer and chat template (transformers'
`apply_chat_template`), so training sees exactly what the server saw. The assistant mask is
found by rendering, not by the template's `{% generation %}` markers (few templates have
them): the conversation up to each assistant turn with the generation prompt marks where
the turn begins, the conversation through the turn marks where it ends, and the turn is
what the model produced up to and including its end-of-turn token. That token is masked
only when the model emitted it (finish_reason `stop`); a turn cut by `max_tokens` never
generated it, and the template's copy is not a training target. Assistant turns that were
part of the prompt (a multi-turn source row) are not the model's output and stay 0.
Reasoning is rendered as the template renders it (`--reasoning inline` and `field` give the
same ids where the template renders `reasoning_content`; see `base.Thinking`).

Where a record carries the engine's own token ids (vLLM's `return_token_ids`, SGLang
0.5.23's `sglext`), those are used as they are (`server_token_ids`), and each row says which
source it used (`metadata.token_source`: `server` or `chat_template`). A row from server ids
is also rendered through the template and compared: where re-tokenising the text does not
give back the ids the model wrote, `metadata.retokenized_differs` is set and the export's
summary counts it — a trainer that re-tokenises the text (SpecForge's conversation path)
would train on other tokens than the model generated for those samples.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.errors import JobError
from draftgen.export.base import (
    ExportContext,
    ExportOptions,
    Format,
    Thinking,
    job_tokenizer,
    load_tokenizer,
    template_render,
)
from draftgen.quality.checks import check_turns


@dataclass(frozen=True, slots=True)
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    text: str


class ChatTokenizer:
    """A Hugging Face tokenizer with its chat template, rendering and masking conversations."""

    def __init__(self, tokenizer: Any, *, template_kwargs: Mapping[str, Any] | None = None,
                 end_markers: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        eos = getattr(tokenizer, "eos_token", None)
        markers = [*end_markers, *([eos] if isinstance(eos, str) and eos else [])]
        # The strings that end an assistant turn when the model stops on its own.
        self.end_markers = tuple(dict.fromkeys(markers))

    @classmethod
    def load(cls, name: str | Path, *,
             template_kwargs: Mapping[str, Any] | None = None) -> ChatTokenizer:
        tok = load_tokenizer(name)
        return cls(tok, template_kwargs=template_kwargs, end_markers=_eos_tokens(tok, name))

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool) -> str:
        return template_render(self.tokenizer, self.template_kwargs)(
            messages, add_generation_prompt)

    def encode(self, messages: Sequence[Mapping[str, Any]],
               targets: Sequence[tuple[int, str | None]]) -> Encoded:
        """Ids of the whole conversation, masked on the generated assistant turns.

        `targets` holds (message index, finish_reason) for each turn the model generated;
        other assistant messages (earlier turns taken from the source) stay unmasked.
        """
        text = self.render(messages, add_generation_prompt=False)
        spans = self.assistant_spans(messages, targets, text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        for i, (start, _end) in enumerate(enc["offset_mapping"]):
            if any(a <= start < b for a, b in spans):
                mask[i] = 1
        return Encoded(ids, mask, text)

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]],
                        targets: Sequence[tuple[int, str | None]],
                        text: str) -> list[tuple[int, int]]:
        """Character spans of `text` that each target turn generated."""
        spans = []
        cursor = 0
        for n, (i, finish) in enumerate(targets):
            head = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            content = str(messages[i].get("content") or "")
            if text.startswith(head):
                start = len(head)
            else:
                # Templates that rewrite earlier turns (e.g. drop their reasoning) are not
                # incremental: find the turn's text after the previous one instead.
                start = text.find(content, cursor) if content else -1
                if start < 0:
                    raise JobError(
                        f"chat template: cannot locate generated turn {n + 1} in the "
                        "rendered conversation; the template rewrites it")
            end = len(through) if text.startswith(through) else len(text)
            end = self._generated_end(text, start, end, content, stopped=finish == "stop")
            spans.append((start, end))
            cursor = end
        return spans

    def _generated_end(self, text: str, start: int, end: int, content: str, *,
                       stopped: bool) -> int:
        seg = text[start:end]
        at = seg.find(content) if content else -1
        after = at + len(content) if at >= 0 else 0
        hits = [(seg.find(mk, after), mk) for mk in self.end_markers]
        hits = [(pos, mk) for pos, mk in hits if pos >= 0]
        if hits:
            pos, mk = min(hits)
            return start + pos + (len(mk) if stopped else 0)
        # No end-of-turn token in the template's rendering: the turn is its text.
        return start + (after if at >= 0 else len(seg.rstrip()))


def generated_turns(rec: Mapping[str, Any],
                    msgs: Sequence[Mapping[str, Any]]) -> list[tuple[int, str | None]]:
    """(message index, finish_reason) of each turn the model generated in `conversation`:
    the assistant messages after the ones that were sent."""
    first = len(rec["messages"])
    at = [i for i in range(first, len(msgs)) if msgs[i]["role"] == "assistant"]
    return [(i, t.get("finish_reason")) for i, t in zip(at, rec["turns"], strict=True)]


def server_token_ids(rec: Mapping[str, Any]) -> tuple[list[int], list[int]] | None:
    """The engine's own ids and loss mask, where the record carries them; None: render.

    A turn's prompt ids followed by its generated ids are exactly what the model read and
    wrote. For several turns the last turn's prompt holds the earlier answers as the
    template re-rendered them; each earlier answer is masked where its generated ids appear
    there unchanged, right after its own prompt, and the record is rendered instead when
    one does not (the template rewrote it, so those ids are not what the model wrote).
    """
    turns = rec.get("turns") or []
    got = [(t.get("prompt_token_ids"), t.get("token_ids")) for t in turns]
    if not got or not all(isinstance(p, list) and isinstance(g, list) for p, g in got):
        return None
    prompt, generated = got[-1]
    mask = [0] * len(prompt)
    for earlier_prompt, earlier in got[:-1]:
        # Turn k's answer follows its own prompt, which the last prompt extends.
        at = len(earlier_prompt)
        if prompt[:at] != earlier_prompt or prompt[at:at + len(earlier)] != earlier:
            return None
        mask[at:at + len(earlier)] = [1] * len(earlier)
    return [*prompt, *generated], mask + [1] * len(generated)


def resolve_tokenizer(ctx: ExportContext, opts: ExportOptions) -> str:
    """`--tokenizer`, else the job's `tokenizer` (relative to the job file)."""
    name = job_tokenizer(ctx, opts)
    if name is None:
        raise JobError(
            "--format tokens needs the model's tokenizer and chat template: pass "
            "--tokenizer DIR (a directory with tokenizer_config.json) or set `tokenizer` "
            "in the job")
    return name


def _eos_tokens(tok: Any, name: str | Path) -> list[str]:
    """End-of-turn tokens from generation_config.json, which lists every id the model
    stops on (chat models often stop on one that is not the tokenizer's eos_token)."""
    try:
        cfg = json.loads((Path(name) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return []
    ids = cfg.get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []
    return [t for t in tok.convert_ids_to_tokens(ids) if isinstance(t, str)]


def _masked(ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    return [i for i, m in zip(ids, mask, strict=True) if m]


class TokensFormat(Format):
    _chat: ChatTokenizer
    retokenized_differs = 0

    def prepare(self, ctx: ExportContext, opts: ExportOptions) -> None:
        super().prepare(ctx, opts)
        name = resolve_tokenizer(ctx, opts)
        self._chat = ChatTokenizer.load(name, template_kwargs=ctx.template_kwargs)
        self.thinking = Thinking(ctx, opts, render=self._render, source=name)
        self.retokenized_differs = 0

    def _render(self, messages: Sequence[Mapping[str, Any]], generation: bool) -> str:
        return self._chat.render(messages, add_generation_prompt=generation)

    def notes(self) -> list[str]:
        notes = super().notes()
        if self.retokenized_differs:
            notes.append(
                f"{self.retokenized_differs} sample(s) re-tokenise to other ids than the "
                "model generated (metadata.retokenized_differs): exported from the server's "
                "ids; a trainer that tokenises the text would not train on what the model "
                "wrote")
        return notes

    def _retokenized(self, msgs: list[dict[str, str]], rec: Mapping[str, Any]
                     ) -> list[int] | None:
        """The generated turns' ids as the chat template and tokenizer would make them;
        None when the template rewrites a turn (nothing to compare)."""
        try:
            enc = self._chat.encode(msgs, generated_turns(rec, msgs))
        except JobError:
            return None
        return _masked(enc.input_ids, enc.loss_mask)

    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        turns = rec["turns"]
        from_server = server_token_ids(rec)
        msgs = self.thinking.conversation(rec)
        differs = False
        if from_server is not None:
            ids, mask = from_server
            text = str(self._chat.tokenizer.decode(ids, skip_special_tokens=False))
            retokenized = self._retokenized(msgs, rec)
            differs = retokenized is not None and retokenized != _masked(ids, mask)
            self.retokenized_differs += differs
        else:
            enc = self._chat.encode(msgs, generated_turns(rec, msgs))
            ids, mask, text = enc.input_ids, enc.loss_mask, enc.text
        meta: dict[str, Any] = {
            "category": rec["category"],
            "partition": rec["partition"],
            "finish_reason": turns[-1].get("finish_reason"),
            "usage": {"prompt_tokens": turns[0].get("prompt_tokens"),
                      "completion_tokens": sum(t.get("completion_tokens") or 0 for t in turns)},
            "server": rec.get("server"),
            "token_source": "server" if from_server is not None else "chat_template",
        }
        if differs:
            meta["retokenized_differs"] = True
        if (kwargs := self.ctx.template_kwargs) is not None:
            meta["chat_template_kwargs"] = kwargs
        if flags := check_turns(turns):
            meta["flags"] = list(flags)
        return {"id": rec["id"], "input_ids": ids, "loss_mask": mask, "text": text,
                "metadata": meta}

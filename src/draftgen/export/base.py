"""What a format writes: its contract and the pieces every format shares.

A format only turns one record into one row (`Format.row`) and, for binary formats, writes
the rows (`Format.write`); `Format.prepare` sees the run once before the first row. Which
records reach it is decided in `writing.py`.

Reasoning is written the way the model's own chat template writes it (`Thinking`): the
template is rendered once with marker strings for a turn's reasoning and answer, and what
it puts around them (`<think>\\n…\\n</think>\\n\\n` for Qwen3-style templates) is the
`inline` wrapper. Without a template, or one that does not render reasoning, `inline` uses
that common convention and the export says so. `field` writes `reasoning_content` on every
generated turn, as thinking templates (and SpecForge's thinking chat templates) read it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson

from draftgen.errors import JobError

Reasoning = Literal["inline", "field", "drop"]
# (messages, add_generation_prompt) -> the template's text.
Render = Callable[[Sequence[Mapping[str, Any]], bool], str]


@dataclass(frozen=True, slots=True)
class ExportOptions:
    format: str = "specforge"
    reasoning: Reasoning = "inline"
    include_truncated: bool = False
    # Also export samples the output checks flagged (loops, leaked reasoning, ...).
    include_flagged: bool = False
    # The model's tokenizer and chat template (a local directory or hub name): the `tokens`
    # format's ids, and how every format writes reasoning. Default: the job's.
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


@dataclass(frozen=True, slots=True)
class ThinkStyle:
    """How a chat template writes a turn's reasoning: after the generation prompt the turn
    is `open + reasoning + close + answer` (what the model generated)."""

    open: str = "<think>\n"
    close: str = "\n</think>\n\n"
    # The template strips newlines around the reasoning / before the answer.
    strip_reasoning: bool = False
    strip_answer: bool = False
    # Whether the template renders `reasoning_content`, and drops the reasoning of turns
    # before the last user message (in the export's own mode); None: no template to ask.
    renders_field: bool | None = None
    drops_earlier: bool | None = None
    # The tokenizer it was derived from; None: the common convention, no template.
    source: str | None = None

    def inline(self, reasoning: str, answer: str) -> str:
        r = reasoning.strip("\n") if self.strip_reasoning else reasoning
        a = answer.lstrip("\n") if self.strip_answer else answer
        return f"{self.open}{r}{self.close}{a}"


COMMON = ThinkStyle()
# Markers for the template probe: plain words no template rewrites, none inside another.
_R, _A, _R0, _A0 = "QxReasonQx", "QxAnswerQx", "QxEarlyReasonQx", "QxEarlyAnswerQx"


def derive_style(render: Render, source: str, mode: Reasoning) -> ThinkStyle:
    """The template's `ThinkStyle`; the common convention where it renders no reasoning."""
    user = {"role": "user", "content": "q"}

    def turn(r: str, a: str) -> dict[str, str]:
        return {"role": "assistant", "content": a, "reasoning_content": r}

    head = render([user], True)
    text = render([user, turn(_R, _A)], False)
    r_at, a_at = text.find(_R), text.find(_A)
    if r_at < 0 or a_at < r_at:
        style = replace(COMMON, renders_field=False, source=source)
    else:
        # The turn starts where the generation prompt ends (as far as the two agree).
        start = min(_common_prefix(head, text), r_at)
        style = ThinkStyle(text[start:r_at], text[r_at + len(_R):a_at], renders_field=True,
                           source=source)
        padded = render([user, turn(f"\n{_R}\n", f"\n{_A}")], False)
        style = replace(style, strip_reasoning=f"{style.open}{_R}{style.close}" in padded,
                        strip_answer=f"{style.close}{_A}" in padded)
    early = (turn(_R0, _A0) if mode == "field"
             else {"role": "assistant", "content": style.inline(_R0, _A0)})
    later = render([user, early, user, turn(_R, _A)], False)
    return replace(style, drops_earlier=_R0 not in later)


_S = "QxSystemQx"


def default_system(render: Render) -> str | None:
    """The system prompt the template writes into a conversation that has none (SmolLM2's
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"); None where it
    writes none, or does not render a system message where this can tell."""
    user = {"role": "user", "content": "q"}
    bare = render([user], True)
    marked = render([{"role": "system", "content": _S}, user], True)
    at = marked.find(_S)
    if at < 0:
        return None
    head, tail = marked[:at], marked[at + len(_S):]
    end = bare.rfind(tail) if tail else len(bare)
    if not bare.startswith(head) or end <= len(head):
        return None
    return bare[len(head):end]


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def job_tokenizer(ctx: ExportContext, opts: ExportOptions) -> str | None:
    """`--tokenizer`, else the job's `tokenizer` (relative to the job file); None: neither."""
    if opts.tokenizer:
        return _tokenizer_dir(Path(opts.tokenizer), opts.tokenizer)
    job = ctx.manifest.get("job") or {}
    name = job.get("tokenizer")
    if not name:
        return None
    path = Path(name)
    job_file = ctx.manifest.get("job_file")
    if not path.is_absolute() and job_file:
        path = Path(job_file).parent / path
    return _tokenizer_dir(path, str(name))


def _tokenizer_dir(path: Path, name: str) -> str:
    if path.is_file():
        # The job may name tokenizer.json itself; its directory has the chat template.
        return str(path.parent)
    # Not a local path: a hub name, which transformers resolves (from its cache, offline).
    return str(path) if path.exists() else name


def load_tokenizer(name: str | Path) -> Any:
    """The Hugging Face tokenizer `name`, which must have a chat template."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise JobError("the model's chat template needs the `transformers` package: "
                       "pip install 'draftgen[tokens]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(name))
    # transformers raises OSError, ValueError and others for a missing or broken tokenizer.
    except Exception as e:
        raise JobError(f"tokenizer {name}: cannot be loaded ({e})") from None
    if not getattr(tok, "chat_template", None):
        raise JobError(f"tokenizer {name}: has no chat template; the export needs the "
                       "model's own template")
    return tok


def template_render(tokenizer: Any, kwargs: Mapping[str, Any] | None) -> Render:
    def render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt, **(kwargs or {})))
    return render


class Thinking:
    """How one export writes reasoning (its template's style, found on the first record
    with reasoning), and what it says about that afterwards."""

    def __init__(self, ctx: ExportContext, opts: ExportOptions, *,
                 mode: Reasoning | None = None, render: Render | None = None,
                 source: str | None = None) -> None:
        self.mode: Reasoning = mode or opts.reasoning
        self._ctx, self._opts = ctx, opts
        self._render, self._source = render, source
        self._style: ThinkStyle | None = None
        self._why = ""  # why the common convention is used
        self.rows = 0  # rows written with reasoning
        self.earlier = 0  # of them, with reasoning on a turn before the last user message

    @property
    def style(self) -> ThinkStyle:
        if self._style is None:
            self._style = self._derive()
        return self._style

    @functools.cached_property
    def template_system(self) -> str | None:
        """What the model's chat template writes as the system prompt of a conversation that
        has none (None: nothing, or no template to ask; `template_known` tells which)."""
        if not self._template() or self._render is None:
            return None
        try:
            return default_system(self._render)
        except Exception:  # a template may raise on anything
            return None

    @property
    def template_known(self) -> bool:
        return self._template()

    def _template(self) -> bool:
        """Load the model's chat template once; False (and why) where there is none."""
        if self._render is not None:
            return True
        if self._why:
            return False
        source = job_tokenizer(self._ctx, self._opts)
        if source is None:
            self._why = "no tokenizer: set `tokenizer` in the job or pass --tokenizer"
            return False
        try:
            self._render = template_render(load_tokenizer(source), self._ctx.template_kwargs)
        except JobError as e:
            self._why = str(e)
            return False
        self._source = source
        return True

    def _derive(self) -> ThinkStyle:
        if not self._template() or self._render is None:
            return COMMON
        render, source = self._render, self._source
        try:
            return derive_style(render, source or "the tokenizer", self.mode)
        # A template may raise on anything (a message shape it refuses, its own checks).
        except Exception as e:
            self._why = f"tokenizer {source}: its template cannot render a probe ({e})"
            return COMMON

    def conversation(self, rec: Mapping[str, Any]) -> list[dict[str, str]]:
        turns = rec["turns"]
        if self.mode == "drop" or not any(t.get("reasoning") for t in turns):
            return conversation(rec, self.mode)
        self.rows += 1
        self.earlier += any(t.get("reasoning") for t in turns[:-1])
        return conversation(rec, self.mode, self.style)

    def notes(self) -> list[str]:
        if not self.rows:
            return []
        st, n, out = self.style, self.rows, []
        common = r"the common <think>\n…\n</think>\n\n convention"
        if self.mode == "inline" and st.source is None:
            out.append(f"{n} row(s) carry reasoning inline in {common}, not derived from the "
                       f"model's chat template ({self._why})")
        elif self.mode == "inline" and not st.renders_field:
            out.append(f"{n} row(s) carry reasoning inline in {common}: the chat template of "
                       f"{st.source} renders no reasoning to derive it from")
        elif self.mode == "inline":
            out.append(f"{n} row(s) carry reasoning inline as the chat template of "
                       f"{st.source} renders it: {st.open!r} + reasoning + {st.close!r} + "
                       "answer")
        elif self.mode == "field" and st.renders_field is False:
            out.append(f"{n} row(s) carry reasoning_content, which the chat template of "
                       f"{st.source} does not render: rendered with it (by --format tokens, "
                       "by SpecForge) the reasoning is dropped (use --reasoning inline)")
        dropped = self.mode == "field" and st.renders_field is False
        if self.earlier and st.drops_earlier is not False and not dropped:
            who = ("the model's chat template renders" if st.drops_earlier else
                   "Qwen3-style chat templates render (no template here to check)")
            out.append(f"{self.earlier} row(s) have reasoning on a turn before the last user "
                       f"message, which {who} without it, as the model saw it at the next "
                       "turn: a trainer that applies the template does not train it")
        return out


def conversation(rec: Mapping[str, Any], reasoning: Reasoning,
                 style: ThinkStyle = COMMON) -> list[dict[str, str]]:
    """Sent messages, then each generated reply, interleaved with the follow-up user turns.

    `inline`: a turn's reasoning before its answer in `content`, in `style`; `field`: every
    generated turn carries `reasoning_content` ("" where the model gave none)."""
    msgs = [dict(m) for m in rec["messages"]]
    followups = list(rec.get("followups") or [])
    for i, turn in enumerate(rec["turns"]):
        if i:
            msgs.append({"role": "user", "content": followups[i - 1]})
        content = turn["content"] or ""
        thought = turn.get("reasoning") or ""
        msg = {"role": "assistant", "content": content}
        if thought and reasoning == "inline":
            msg["content"] = style.inline(thought, content)
        elif reasoning == "field":
            msg["reasoning_content"] = thought
        msgs.append(msg)
    return msgs


class Format:
    suffix = ".jsonl"
    ctx: ExportContext
    thinking: Thinking

    def prepare(self, ctx: ExportContext, opts: ExportOptions) -> None:
        """Called once before the first row; loads what every row shares."""
        self.ctx = ctx
        self.thinking = Thinking(ctx, opts)

    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        raise NotImplementedError

    def notes(self) -> list[str]:
        """What the export's summary should say about the rows written (after writing)."""
        return self.thinking.notes()

    def write(self, rows: Iterator[dict[str, Any]], f: BinaryIO) -> None:
        for r in rows:
            f.write(orjson.dumps(r) + b"\n")

"""`draftgen probe`: run the A/B probe over chat prompts on two servers (the measure is
in `drift.py`, the servers' scoring endpoints in `servers.py`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from draftgen.client.http import open_session
from draftgen.engines.registry import scoring_server as connect
from draftgen.engines.scoring import Http, ScoringServer
from draftgen.errors import DraftgenError, JobError
from draftgen.job import Source
from draftgen.probe.drift import (
    ProbeResult,
    ProbeThresholds,
    PromptProbe,
    compare_prompt,
    format_report,
    summarise,
)
from draftgen.probe.gate import GateSettings, PromptPaths, gate_prompt, judge
from draftgen.sample import Message
from draftgen.sources.base import RowRejection, normalise_row, shape
from draftgen.store.atomic import write_atomic

DEMO_PROMPTS_DIR = Path(__file__).resolve().parents[3] / "examples" / "demo" / "prompts"
# Used when neither --prompts nor the demo prompts (a source checkout) are at hand.
BUILTIN_PROMPTS = (
    "Explain the difference between weather and climate in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A train leaves at 09:40 and arrives at 13:05. How long is the journey?",
    "Translate into French: 'The library opens at nine on weekdays.'",
    "List three ways to reduce the memory use of a large pandas DataFrame.",
    "If all bloops are razzies and some razzies are lazzies, must some bloops be lazzies?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What does the HTTP status code 429 mean, and how should a client react to it?",
)


async def _probe_one(index: int, messages: Sequence[Message], ref: ScoringServer,
                     cand: ScoringServer, max_tokens: int, top_k: int,
                     gate: GateSettings | None) -> tuple[PromptProbe, PromptPaths | None]:
    prompt = await ref.render(messages)
    ref_out = await ref.greedy(prompt, max_tokens)
    async with asyncio.TaskGroup() as tg:
        ref_pos = tg.create_task(ref.score(prompt, ref_out, top_k))
        cand_pos = tg.create_task(cand.score(prompt, ref_out, top_k))
        cand_out = tg.create_task(cand.greedy(prompt, max_tokens))
    prefill = compare_prompt(index, len(prompt), ref_out, cand_out.result(), ref_pos.result(),
                             cand_pos.result())
    paths = None if gate is None else await gate_prompt(
        prompt, ref, cand, max_tokens=max_tokens, top_k=top_k, cache_read=gate.cache_read)
    return prefill, paths


async def run_probe(
    reference: str,
    candidate: str,
    prompts: Sequence[Sequence[Message]],
    *,
    n: int,
    max_tokens: int,
    top_k: int,
    model: str | None,
    thresholds: ProbeThresholds,
    api_key: str | None = None,
    concurrency: int = 8,
    timeout_s: float = 600.0,
    gate: GateSettings | None = GateSettings(),  # noqa: B008 (frozen)
) -> ProbeResult:
    """Probe the first `n` prompts; raises ProbeError when a server cannot be used.
    `gate` adds the decode and cache-read paths against the noise floor (None: prefill
    only)."""
    if n < 1 or max_tokens < 1 or top_k < 1 or concurrency < 1:
        raise ValueError("n, max_tokens, top_k and concurrency must be at least 1")
    if not prompts:
        raise ValueError("no prompts to probe")
    chosen = prompts[:n]
    results: list[tuple[PromptProbe, PromptPaths | None] | None] = [None] * len(chosen)
    async with open_session(timeout_s=timeout_s) as session:
        http = Http(session, api_key)
        ref = await connect(http, reference, model)
        cand = await connect(http, candidate, model)
        todo = iter(enumerate(chosen))

        async def worker() -> None:
            for i, messages in todo:
                results[i] = await _probe_one(i, messages, ref, cand, max_tokens, top_k, gate)

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(concurrency, len(chosen))):
                    tg.create_task(worker())
        except ExceptionGroup as group:
            # One failed request stops the probe; its own error says more than the group.
            raise _first_leaf(group) from None
    done = [r for r in results if r is not None]
    result = summarise(reference, candidate, (ref.kind, cand.kind), ref.model, max_tokens,
                       top_k, thresholds, tuple(p for p, _ in done))
    if gate is None:
        return result
    paths = [g for _, g in done if g is not None]
    return replace(result, gate=judge(paths, gate, max_tokens))


def _first_leaf(group: ExceptionGroup[Exception]) -> Exception:
    e: Exception = group
    while isinstance(e, ExceptionGroup):
        e = e.exceptions[0]
    return e


def load_prompts(path: Path | None, set_aside: list[str] | None = None) -> list[list[Message]]:
    """Chat prompts from a JSONL file of rows with `messages` (OpenAI), `conversations`
    (ShareGPT) or one `prompt`/`instruction`/`question` field; None: the demo prompts, taken in
    turn from each category file so a small n still covers every kind (a built-in list
    outside a source checkout). Unusable rows are skipped, each with `file:line: reason`
    appended to `set_aside`, as `plan` does; a file with no usable row is a JobError."""
    if path is not None:
        return _read_messages(path, set_aside)
    files = sorted(DEMO_PROMPTS_DIR.glob("*.jsonl"))
    if not files:
        return [[{"role": "user", "content": text}] for text in BUILTIN_PROMPTS]
    columns = [_read_messages(f, set_aside) for f in files]
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


def _read_messages(path: Path, set_aside: list[str] | None) -> list[list[Message]]:
    # Each row's layout is recognised by its key, so the demo's mixed files read as they are.
    layouts = {name: Source(path=str(path), layout=name)
               for name in ("messages", "conversations", "prompt")}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise JobError(f"{path}: cannot read prompts: {e.strerror}") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row: object = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            row = ValueError(e.msg)
        try:
            layout = next((k for k in ("messages", "conversations")
                           if isinstance(row, dict) and k in row), "prompt")
            messages, _ = shape(normalise_row(row, layouts[layout]), "last", None)
        except RowRejection as e:
            if set_aside is not None:
                set_aside.append(f"{path}:{lineno}: {e}")
            continue
        prompts.append(list(messages))
    if not prompts:
        raise JobError(f"{path}: no usable prompt rows")
    return prompts


def probe_command(
    reference: str,
    candidate: str,
    prompts_file: Path | None,
    n: int,
    max_tokens: int,
    top_k: int,
    json_out: Path | None,
    *,
    model: str | None = None,
    api_key: str | None = None,
    thresholds: ProbeThresholds | None = None,
    gate: GateSettings | None = GateSettings(),  # noqa: B008 (frozen)
) -> int:
    """Run the probe and print the table: 0 pass, 1 fail, 2 no verdict (a usage error, or
    a server that could not be probed; the reason goes to stderr)."""
    if n < 1 or max_tokens < 1 or top_k < 1:
        print("probe: -n, --max-tokens and --top-k must be at least 1", file=sys.stderr)
        return 2
    set_aside: list[str] = []
    try:
        prompts = load_prompts(prompts_file, set_aside)
        # The demo files keep a few broken rows on purpose; only a user's file is reported.
        if set_aside and prompts_file is not None:
            print(f"probe: {len(set_aside)} unusable prompt rows set aside, first: "
                  f"{set_aside[0]}", file=sys.stderr)
        result = asyncio.run(run_probe(
            reference, candidate, prompts, n=n, max_tokens=max_tokens, top_k=top_k,
            model=model, thresholds=thresholds or ProbeThresholds(), api_key=api_key,
            gate=gate,
        ))
        print(format_report(result))
        if json_out is not None:
            write_atomic(json_out, orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2))
    except DraftgenError as e:
        print(f"probe: {e}", file=sys.stderr)
        return 2
    return 0 if result.passed else 1

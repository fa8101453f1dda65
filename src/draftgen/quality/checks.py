"""Output checks: flag generated turns a drafter should not learn from, with a reason code.

Every check reads one turn's text once (O(length)), so the writer can run them on every
record. Refusals are deliberately not flagged: the drafter must learn the target model's
refusals as much as its answers.

Codes (stable: they are stored in ledgers and counted by `status`):

- `empty_answer`: the answer is blank and there is no reasoning either.
- `reasoning_without_answer`: the model reasoned, then stopped without answering. When
  the turn was cut by `max_tokens` instead, that is `truncated_in_reasoning`.
- `repetition_loop`: the tail of the answer (or of the reasoning) is dominated by a
  repeating stretch of text.
- `leaked_reasoning`: reasoning markers such as `<think>` appear in the answer, so the
  server's reasoning parser did not separate them.
- `truncated_in_reasoning` / `truncated_in_answer`: the turn hit `max_tokens`
  (finish_reason `length`), before or after the answer began.
"""

from __future__ import annotations

import re
import string
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from draftgen.sample import Turn

EMPTY_ANSWER = "empty_answer"
REASONING_WITHOUT_ANSWER = "reasoning_without_answer"
REPETITION_LOOP = "repetition_loop"
LEAKED_REASONING = "leaked_reasoning"
TRUNCATED_IN_REASONING = "truncated_in_reasoning"
TRUNCATED_IN_ANSWER = "truncated_in_answer"

# In the order flags are reported.
ALL_FLAGS = (EMPTY_ANSWER, REASONING_WITHOUT_ANSWER, REPETITION_LOOP, LEAKED_REASONING,
             TRUNCATED_IN_REASONING, TRUNCATED_IN_ANSWER)
# Truncation has its own export rule (`include_truncated`); these never make a sample
# "flagged" on their own.
TRUNCATION_FLAGS = frozenset({TRUNCATED_IN_REASONING, TRUNCATED_IN_ANSWER})

# Opening and closing reasoning markers of the common reasoning formats (DeepSeek/Qwen
# `<think>`, Kimi's `◁think▷`, and the `<|thinking|>` family).
REASONING_MARKERS: tuple[str, ...] = (
    "<think>", "</think>", "<|thinking|>", "<|/thinking|>", "<|end_thinking|>",
    "◁think▷", "◁/think▷",
)

# Repetition. A loop is a stretch of text said over and over at a steady period. In the
# last SCORE_CHARS of the text the check counts the 5-word sequences that are at least the
# MIN_OCCURRENCE-th occurrence of that sequence within the last WINDOW_CHARS and that recur
# at the most common distance (the period, give or take PERIOD_SLACK words). A verbatim
# loop of any period up to about (WINDOW_CHARS - SCORE_CHARS) / 3 scores near 1, and small
# edits between copies lower it only a little; a block of code quoted twice (the original,
# then a fix) scores near 0, as do prose, lists, tables and JSON. Words only: punctuation
# and layout recur in every line of code or JSON and would make a period of their own.
# Tuned on crafted cases (tests/unit/quality/test_checks.py; the lowest loop scores 0.63, the
# highest non-loop 0.08) and on the Python standard library: 0.06% of its modules' tail
# windows reach LOOP_SHARE, and 0.2% of its test files', all of them runs of copied
# methods.
WINDOW_CHARS = 6000
SCORE_CHARS = 600
# Shorter text is not judged: too little to tell a loop from a short list.
MIN_CHARS = 400
NGRAM = 5
MIN_OCCURRENCE = 4
LOOP_SHARE = 0.55
# Tails that zlib compresses worse than this are not looked at further (loops: < 0.1).
GATE_RATIO = 0.25
# Distances within this many words of each other count as one period (an inserted or
# dropped word between copies).
PERIOD_SLACK = 2
# Capped, so that a runaway word ("aaaa…", "9999…") is many equal words rather than one.
_WORD = re.compile(r"\w{1,16}")
_BLANKS = frozenset(string.whitespace)


def check_turns(
    turns: Sequence[Turn | Mapping[str, Any]],
    *,
    reasoning_markers: Sequence[str] = REASONING_MARKERS,
) -> tuple[str, ...]:
    """The flags of a sample's generated turns (records or their stored JSON), in `ALL_FLAGS`
    order; empty when nothing is wrong."""
    found: set[str] = set()
    for turn in turns:
        if isinstance(turn, Turn):
            fields: tuple[object, object, object] = (
                turn.content, turn.reasoning, turn.finish_reason)
        else:
            fields = (turn.get("content"), turn.get("reasoning"), turn.get("finish_reason"))
        content, reasoning, finish = fields
        found.update(_check_turn(str(content or ""), str(reasoning or ""),
                                 finish, reasoning_markers))
    return tuple(f for f in ALL_FLAGS if f in found)


def quality_flags(flags: Sequence[str] | None) -> list[str]:
    """The flags that make a sample "flagged" (everything but the truncation codes)."""
    return [f for f in flags or () if f not in TRUNCATION_FLAGS]


def _check_turn(content: str, reasoning: str, finish: object,
                markers: Sequence[str]) -> list[str]:
    flags = []
    answered = bool(content.strip())
    reasoned = bool(reasoning.strip())
    truncated = finish == "length"
    if not answered and not reasoned:
        flags.append(EMPTY_ANSWER)
    elif not answered and not truncated:
        flags.append(REASONING_WITHOUT_ANSWER)
    if is_repetition_loop(content) or is_repetition_loop(reasoning):
        flags.append(REPETITION_LOOP)
    if answered and any(m in content for m in markers):
        flags.append(LEAKED_REASONING)
    if truncated:
        flags.append(TRUNCATED_IN_REASONING if reasoned and not answered
                     else TRUNCATED_IN_ANSWER)
    return flags


def repetition_share(text: str) -> float:
    """The share of the tail's n-grams that repeat, at one steady distance, a sequence seen
    at least MIN_OCCURRENCE - 1 times before in the window.

    The steady distance (the loop's period, give or take a token) is what tells a loop from
    code or lists, whose recurring phrases come at irregular distances. 0.0 for text too
    short to judge (under MIN_CHARS, ignoring blanks, unless it is a runaway of newlines).
    """
    window = text[-WINDOW_CHARS:]
    if len(window.strip()) < MIN_CHARS and window.count("\n") < MIN_CHARS:
        return 0.0
    if not _compresses_like_a_loop(window):
        return 0.0
    if len(set(window[-SCORE_CHARS:]) - _BLANKS) <= 1:
        # A runaway of one character ("!!!!…", "\n\n\n…", "=====…"): no words to count.
        return 1.0
    tokens = _WORD.findall(window)
    scored_tokens = len(_WORD.findall(window[-SCORE_CHARS:]))
    grams = len(tokens) - NGRAM + 1
    first_scored = max(0, grams - scored_tokens)
    if grams - first_scored < NGRAM:
        return 0.0
    count: dict[tuple[str, ...], int] = {}
    last: dict[tuple[str, ...], int] = {}
    distances: Counter[int] = Counter()
    for i in range(grams):
        gram = tuple(tokens[i:i + NGRAM])
        n = count.get(gram, 0) + 1
        count[gram] = n
        if n >= MIN_OCCURRENCE and i >= first_scored:
            distances[i - last[gram]] += 1
        last[gram] = i
    if not distances:
        return 0.0
    steady = max(sum(distances[d + k] for k in range(-PERIOD_SLACK, PERIOD_SLACK + 1))
                 for d in distances)
    return steady / (grams - first_scored)


def is_repetition_loop(text: str) -> bool:
    return repetition_share(text) >= LOOP_SHARE


def _compresses_like_a_loop(window: str) -> bool:
    # A cheap gate (C speed, ~10x faster than counting n-grams): a looping tail compresses
    # to under a tenth of its size given the text before it as a dictionary; prose
    # compresses to about half, and most code to a third.
    data = window.encode()
    head, tail = data[:-SCORE_CHARS], data[-SCORE_CHARS:]
    z = zlib.compressobj(level=1, zdict=head) if head else zlib.compressobj(level=1)
    return len(z.compress(tail) + z.flush()) <= GATE_RATIO * len(tail)


# What a trainer that renders conversations itself (SpecForge) adds to a sample under the
# loss beyond what the target wrote, by what the sample holds (export/specforge.py and the
# dataset card count and explain them).
TRAINER_GAPS = ("source_turns", "no_system", "truncated")


def trainer_gaps(record: Mapping[str, Any]) -> list[str]:
    """The TRAINER_GAPS that apply to a stored record: assistant turns from the source
    prompt, no system prompt, a turn cut at max_tokens."""
    messages = record.get("messages") or []
    gaps = []
    if any(m.get("role") == "assistant" for m in messages):
        gaps.append("source_turns")
    if not messages or messages[0].get("role") != "system":
        gaps.append("no_system")
    if any(t.get("finish_reason") == "length" for t in record.get("turns") or []):
        gaps.append("truncated")
    return gaps

"""Turning raw source rows into the messages a sample sends.

A reader subclass only yields raw rows. Everything after that (field lookup, ShareGPT role
names, content-part lists, role-order rules, multi-turn shaping, ids) happens once, here, so
every format rejects the same rows for the same reasons. A row that cannot become a prompt
is a `Rejected` with a reason `"<code>: <detail>"`; the code before the colon is stable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from draftgen.job import Source
from draftgen.sample import Message, Rejected

MALFORMED_JSON = "malformed_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
EMPTY_PROMPT = "empty_prompt"
INVALID_ROLES = "invalid_roles"
NON_TEXT_CONTENT = "non_text_content"
DUPLICATE_ID = "duplicate_id"

# Tried in order when a `prompt` layout names no field.
PROMPT_FIELDS = ("prompt", "instruction", "question")

# ShareGPT speaker names, plus OpenAI's own, so either list shape works under either layout.
_ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}


class SourceRow(NamedTuple):
    """One raw row: its number in the source and the decoded object, or why it did not decode.

    Numbers are 1-based lines for JSONL files and 0-based indices for Parquet, JSON arrays
    and Hugging Face datasets, so each points where a person would look.
    """

    row: int
    data: object


@dataclass(frozen=True, slots=True)
class SourcePrompt:
    """A valid row, shaped into what a sample sends."""

    row: int
    messages: tuple[Message, ...]
    followups: tuple[str, ...]
    id: str | None


class RowRejection(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


def reason_code(reason: str) -> str:
    """The stable part of a rejection reason (`"missing_field: ..."` -> `"missing_field"`)."""
    return reason.split(":", 1)[0]


class SampleReader(ABC):
    """Reads one category's source; subclasses implement only `iter_rows`."""

    def __init__(self, source: Source, name: str) -> None:
        self.source = source
        # How rejections and samples name the source: the path as the job file wrote it.
        self.name = name

    @abstractmethod
    def iter_rows(self) -> Iterator[SourceRow]:
        """Yield every row in source order; a row that cannot be decoded yields its exception."""

    def read(
        self,
        category: str,
        multi_turn: Literal["last", "all"] = "last",
        system_prompt: str | None = None,
    ) -> Iterator[SourcePrompt | Rejected]:
        """Every row, in order, as a prompt to send or as a rejection with its reason."""
        seen_ids: set[str] = set()
        for row, data in self.iter_rows():
            try:
                turns = normalise_row(data, self.source)
                messages, followups = shape(turns, multi_turn, system_prompt)
                row_id = read_id(data, self.source.id_field)
                if row_id is not None:
                    if row_id in seen_ids:
                        raise RowRejection(DUPLICATE_ID, f"id {row_id!r} is used by an earlier row")
                    seen_ids.add(row_id)
            except RowRejection as r:
                yield Rejected(category=category, source=self.name, row=row, reason=str(r))
                continue
            yield SourcePrompt(row=row, messages=messages, followups=followups, id=row_id)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _a_json_type(value: object) -> str:
    """The JSON type of `value` with its article: "an array", "a string"."""
    name = _json_type(value)
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def normalise_row(data: object, source: Source) -> tuple[Message, ...]:
    """The row's whole conversation as `{role, content}` messages with valid role order."""
    if isinstance(data, Exception):
        raise RowRejection(MALFORMED_JSON, str(data) or type(data).__name__)
    if not isinstance(data, dict):
        raise RowRejection(NOT_AN_OBJECT, f"row is a JSON {_json_type(data)}, not an object")
    if source.layout == "prompt":
        return ({"role": "user", "content": _prompt_text(data, source.field)},)
    name = source.field or source.layout
    turns = data.get(name)
    if turns is None:
        raise RowRejection(MISSING_FIELD, f"no {name!r} field")
    if not isinstance(turns, list | tuple):
        raise RowRejection(WRONG_TYPE, f"{name!r} is {_a_json_type(turns)}, expected an array")
    if not turns:
        raise RowRejection(EMPTY_PROMPT, f"{name!r} is an empty array")
    messages = tuple(_message(f"{name}[{i}]", t) for i, t in enumerate(turns))
    _check_roles(messages, name)
    return messages


def _prompt_text(data: dict[str, Any], field: str | None) -> str:
    names = (field,) if field else PROMPT_FIELDS
    used = next((n for n in names if data.get(n) is not None), None)
    if used is None:
        raise RowRejection(MISSING_FIELD, "no " + " or ".join(repr(n) for n in names) + " field")
    text = data[used]
    if not isinstance(text, str):
        raise RowRejection(WRONG_TYPE, f"{used!r} is {_a_json_type(text)}, expected a string")
    # Alpaca-style rows keep the material the instruction refers to in a separate `input`.
    extra = data.get("input")
    if used == "instruction" and field is None and isinstance(extra, str) and extra.strip():
        text = f"{text}\n\n{extra}"
    return text


def _message(where: str, item: object) -> Message:
    if not isinstance(item, dict):
        raise RowRejection(WRONG_TYPE, f"{where} is {_a_json_type(item)}, expected an object")
    if "role" in item:
        role_key, content_key = "role", "content"
    elif "from" in item:
        role_key, content_key = "from", "value"
    else:
        raise RowRejection(MISSING_FIELD, f"{where} has no 'role' (or ShareGPT 'from')")
    role = item[role_key]
    if not isinstance(role, str):
        raise RowRejection(WRONG_TYPE, f"{where}.{role_key} is {_a_json_type(role)}")
    if role not in _ROLES:
        raise RowRejection(INVALID_ROLES, f"{where} has unknown role {role!r}")
    if content_key not in item:
        raise RowRejection(MISSING_FIELD, f"{where} has no {content_key!r}")
    return {
        "role": _ROLES[role],
        "content": _content_text(f"{where}.{content_key}", item[content_key]),
    }


def _content_text(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise RowRejection(
            WRONG_TYPE, f"{where} is {_a_json_type(content)}, expected a string or parts"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RowRejection(WRONG_TYPE, f"{where}[{j}] is {_a_json_type(part)}")
        if part.get("type") != "text":
            raise RowRejection(
                NON_TEXT_CONTENT,
                f"{where}[{j}] has type {part.get('type')!r}; only text parts are supported",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RowRejection(WRONG_TYPE, f"{where}[{j}].text is {_a_json_type(text)}")
        texts.append(text)
    # vLLM and SGLang join text parts with a newline when they render the template.
    return "\n".join(texts)


def _check_roles(messages: tuple[Message, ...], name: str) -> None:
    """OpenAI's order: an optional system message, then user/assistant alternating from user."""
    start = 1 if messages[0]["role"] == "system" else 0
    for i in range(start, len(messages)):
        role = messages[i]["role"]
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if role != expected:
            if role == "system":
                detail = f"{name}[{i}] is a system message; only the first may be"
            else:
                detail = f"{name}[{i}] is {role!r} where {expected!r} was expected"
            raise RowRejection(INVALID_ROLES, detail)
    if len(messages) == start:
        raise RowRejection(INVALID_ROLES, f"{name!r} has no user turn")


def shape(
    turns: tuple[Message, ...],
    multi_turn: Literal["last", "all"],
    system_prompt: str | None,
) -> tuple[tuple[Message, ...], tuple[str, ...]]:
    """Split a valid conversation into the messages sent first and the later user turns.

    "last" sends everything up to the last user turn (the source's earlier replies stay as
    context); "all" sends the first user turn and keeps the rest as followups, because every
    reply will be regenerated. A category's `system_prompt` replaces the row's own; an empty
    one removes it.
    """
    system = turns[0] if turns[0]["role"] == "system" else None
    body = turns[1:] if system is not None else turns
    users = [i for i, m in enumerate(body) if m["role"] == "user"]
    followups: tuple[str, ...] = ()
    if multi_turn == "last":
        sent = body[: users[-1] + 1]
    else:
        sent = body[: users[0] + 1]
        followups = tuple(body[i]["content"] for i in users[1:])
    if system_prompt is not None:
        system = {"role": "system", "content": system_prompt} if system_prompt else None
    messages = (system, *sent) if system is not None else sent
    for i, m in enumerate(messages):
        if not m["content"].strip():
            raise RowRejection(EMPTY_PROMPT, f"message {i} ({m['role']}) is empty")
    for i, text in enumerate(followups):
        if not text.strip():
            raise RowRejection(EMPTY_PROMPT, f"follow-up user turn {i + 1} is empty")
    return messages, followups


def read_id(data: object, id_field: str | None) -> str | None:
    if id_field is None:
        return None
    assert isinstance(data, dict)  # normalise_row has already rejected anything else
    value = data.get(id_field)
    if value is None:
        raise RowRejection(MISSING_FIELD, f"no id field {id_field!r}")
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RowRejection(
            WRONG_TYPE, f"id field {id_field!r} is {_a_json_type(value)}, expected string or int"
        )
    text = str(value)
    if not text.strip():
        raise RowRejection(MISSING_FIELD, f"id field {id_field!r} is empty")
    return text

"""Reading a YAML file into a validated pydantic model, with errors that name file and field.

Every problem is one `JobError` of one line: the file, then where in it (a field path, or
a line and column for YAML syntax), then what is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from draftgen.errors import JobError

M = TypeVar("M", bound=BaseModel)


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; a job file saying `seed: 1`
    and later `seed: 2` is a mistake to point out, not a choice to make silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` keys may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class says so
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _yaml_problem(err: yaml.YAMLError) -> str:
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        context = f" ({err.context})" if err.context else ""
        return _one_line(f"{where}{err.problem or 'unreadable'}{context}")
    return _one_line(str(err))


def _format_error(path: Path, what: str, err: ValidationError) -> str:
    problems = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        problems.append(f"{loc}: {_one_line(msg)}")
    return f"{path}: invalid {what}: " + "; ".join(problems)


def load_yaml(path: Path, what: str) -> object:
    """The file's YAML document, with duplicate keys refused; a JobError names `path`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise JobError(f"{path}: cannot read {what}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobError(f"{path}: {what} is not UTF-8 text (byte {e.start}: "
                       f"{data[e.start:e.start + 1]!r})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None


def load_model(path: str | Path, model: type[M], what: str) -> M:
    """`what` names the kind of file in messages ("job file", "server profile")."""
    p = Path(path)
    raw = load_yaml(p, what)
    if not isinstance(raw, dict):
        found = "empty" if raw is None else f"a YAML {type(raw).__name__}"
        raise JobError(f"{p}: a {what} must be a mapping of fields (this one is {found})")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise JobError(_format_error(p, what, e)) from None

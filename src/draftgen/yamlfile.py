"""Reading a YAML file into a validated pydantic model, with errors that name file and field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from draftgen.errors import JobError

M = TypeVar("M", bound=BaseModel)


def _format_error(path: Path, what: str, err: ValidationError) -> str:
    lines = [f"{path}: invalid {what}"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_model(path: str | Path, model: type[M], what: str) -> M:
    """`what` names the kind of file in messages ("job file", "server profile")."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise JobError(f"{p}: cannot read {what}: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JobError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise JobError(f"{p}: a {what} must be a mapping of fields")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise JobError(_format_error(p, what, e)) from None

"""Prompt sources: read JSONL, Parquet or Hugging Face rows as prompts to send.

`open_source` picks a reader for a category's `Source`; `SampleReader.read` yields each row
as a `SourcePrompt` or a `Rejected` with its reason.
"""

from __future__ import annotations

from pathlib import Path

from draftgen.errors import JobError
from draftgen.job import Source
from draftgen.sources.base import (
    PROMPT_FIELDS,
    SampleReader,
    SourcePrompt,
    SourceRow,
    reason_code,
)

__all__ = [
    "PROMPT_FIELDS",
    "SampleReader",
    "SourcePrompt",
    "SourceRow",
    "open_source",
    "reason_code",
    "source_name",
]

_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


def source_name(source: Source) -> str:
    """How rejections and sample `source` fields name where a row came from."""
    if source.path is not None:
        return source.path
    name = f"hf:{source.hf_dataset}"
    if source.hf_config:
        name += f"/{source.hf_config}"
    return f"{name}[{source.hf_split}]"


def open_source(source: Source, base_dir: Path) -> SampleReader:
    """A reader for `source`; relative paths resolve from `base_dir` (the job file's folder)."""
    name = source_name(source)
    if source.hf_dataset is not None:
        from draftgen.sources.hf import HfReader

        local = base_dir / Path(source.hf_dataset).expanduser()
        dataset = str(local) if local.exists() else source.hf_dataset
        return HfReader(source, dataset, name)

    assert source.path is not None  # Source allows exactly one origin
    path = base_dir / Path(source.path).expanduser()
    fmt: str = source.format
    if fmt == "auto":
        suffix = path.suffix.lower()
        if suffix not in _EXTENSIONS:
            raise JobError(
                f"{name}: cannot tell the format from the extension {suffix or '(none)'!r}; "
                "set source.format to 'jsonl' or 'parquet'"
            )
        fmt = _EXTENSIONS[suffix]
    if path.is_dir():
        raise JobError(f"{name}: is a directory, not a source file ({path})")
    if not path.is_file():
        raise JobError(f"{name}: no such file ({path})")
    if fmt == "parquet":
        from draftgen.sources.parquet import ParquetReader

        return ParquetReader(source, path, name)
    from draftgen.sources.jsonl import JsonlReader

    return JsonlReader(source, path, name)

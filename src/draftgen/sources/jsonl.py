"""JSON Lines files (and `.json` files holding one JSON array of rows)."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import orjson

from draftgen.errors import JobError
from draftgen.job import Source
from draftgen.sources.base import SampleReader, SourceRow


class JsonlReader(SampleReader):
    """Streams a file line by line, so a large source never sits in memory whole."""

    def __init__(self, source: Source, path: Path, name: str) -> None:
        super().__init__(source, name)
        self.path = path
        # Only a `.json` file may be one array; in a `.jsonl` file a line that is an
        # array is a bad row like any other.
        self.may_be_array = path.suffix.lower() == ".json"

    def iter_rows(self) -> Iterator[SourceRow]:
        try:
            f = self.path.open("rb")
        except OSError as e:
            raise JobError(f"{self.name}: cannot read source: {e.strerror}") from None
        with f:
            if self.may_be_array and _starts_array(f):
                yield from self._array_rows(f.read())
                return
            for lineno, line in enumerate(f, 1):
                if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                    line = line[len(codecs.BOM_UTF8) :]
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    continue
                try:
                    yield SourceRow(lineno, orjson.loads(line))
                except orjson.JSONDecodeError as e:
                    # orjson's own text says "line 1"; the row number already names the line.
                    yield SourceRow(lineno, ValueError(f"{e.msg} at column {e.colno}"))

    def _array_rows(self, data: bytes) -> Iterator[SourceRow]:
        # Many ShareGPT-style datasets ship as one pretty-printed array; read it whole
        # rather than reject every line of it.
        try:
            rows = orjson.loads(data.removeprefix(codecs.BOM_UTF8))
        except orjson.JSONDecodeError as e:
            raise JobError(f"{self.name}: not valid JSON: {e}") from None
        for i, row in enumerate(rows):
            yield SourceRow(i, row)


def _starts_array(f: BinaryIO) -> bool:
    """Whether the first non-blank byte is `[`; leaves the file at its start."""
    head = f.read(4096)
    f.seek(0)
    return head.removeprefix(codecs.BOM_UTF8).lstrip()[:1] == b"["

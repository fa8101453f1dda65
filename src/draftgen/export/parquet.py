"""Parquet: one row per sample, conversation plus the metadata a data team filters on."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any, BinaryIO

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from draftgen.export.base import ExportContext, ExportOptions, Format

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("category", pa.string()),
    ("partition", pa.string()),
    ("conversations", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                          ("reasoning_content", pa.string())]))),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("server", pa.string()),
    # JSON text of the request's chat_template_kwargs (the thinking switch), or null.
    ("chat_template_kwargs", pa.string()),
])


class ParquetFormat(Format):
    suffix = ".parquet"
    _kwargs_json: str | None = None

    def row(self, rec: dict[str, Any], opts: ExportOptions) -> dict[str, Any]:
        turns = rec["turns"]
        return {
            "id": rec["id"],
            "category": rec["category"],
            "partition": rec["partition"],
            "conversations": self.thinking.conversation(rec),
            "finish_reason": turns[-1]["finish_reason"],
            "prompt_tokens": turns[0]["prompt_tokens"],
            "completion_tokens": sum(t["completion_tokens"] for t in turns),
            "server": rec["server"],
            "chat_template_kwargs": self._kwargs_json,
        }

    def prepare(self, ctx: ExportContext, opts: ExportOptions) -> None:
        super().prepare(ctx, opts)
        kwargs = ctx.template_kwargs
        self._kwargs_json = orjson.dumps(kwargs).decode() if kwargs is not None else None

    def write(self, rows: Iterator[dict[str, Any]], f: BinaryIO) -> None:
        with pq.ParquetWriter(f, SCHEMA) as w:
            while batch := list(islice(rows, 4096)):
                w.write_table(pa.Table.from_pylist(batch, schema=SCHEMA))

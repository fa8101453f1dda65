"""Parquet files, read one record batch at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from draftgen.errors import JobError
from draftgen.job import Source
from draftgen.sources.base import SampleReader, SourceRow

BATCH_ROWS = 4096


class ParquetReader(SampleReader):
    def __init__(self, source: Source, path: Path, name: str) -> None:
        super().__init__(source, name)
        self.path = path

    def iter_rows(self) -> Iterator[SourceRow]:
        index = 0
        try:
            pf = pq.ParquetFile(self.path)
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                for row in batch.to_pylist():
                    yield SourceRow(index, row)
                    index += 1
        # A file that is not Parquet fails on open; a damaged one (a bad page, a cut-off
        # column chunk) can fail at any batch: either way the source cannot be read whole.
        except (OSError, pa.ArrowException) as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            where = f" after row {index - 1}" if index else ""
            raise JobError(f"{self.name}: cannot read Parquet source{where}: {detail}") from None

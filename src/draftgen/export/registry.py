"""The formats `draftgen export --format` knows, by name (apart from `base.py`, which every
format imports)."""

from __future__ import annotations

from draftgen.export.base import Format
from draftgen.export.parquet import ParquetFormat
from draftgen.export.sharegpt import ShareGPTFormat
from draftgen.export.specforge import SpecForgeFormat
from draftgen.export.token_ids import TokensFormat


def formats() -> dict[str, Format]:
    """A fresh instance of every format (a format keeps per-export state from `prepare`)."""
    return {"specforge": SpecForgeFormat(), "sharegpt": ShareGPTFormat(),
            "parquet": ParquetFormat(), "tokens": TokensFormat()}

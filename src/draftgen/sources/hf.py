"""Hugging Face datasets, by hub name or local path; `datasets` is an optional extra."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

from draftgen.errors import HostError, JobError
from draftgen.job import Source
from draftgen.sources.base import SampleReader, SourceRow


def _import_datasets() -> ModuleType:
    try:
        return importlib.import_module("datasets")
    except ImportError:
        raise HostError(
            "reading 'hf_dataset' sources needs the datasets library: pip install 'draftgen[hf]'"
        ) from None


class HfReader(SampleReader):
    def __init__(self, source: Source, dataset: str, name: str) -> None:
        super().__init__(source, name)
        # Import now, so a missing extra fails when the job is opened, not mid-plan.
        self._datasets = _import_datasets()
        # A hub name, or a local directory already resolved against the job file.
        self.dataset = dataset

    def iter_rows(self) -> Iterator[SourceRow]:
        src = self.source
        try:
            ds = self._datasets.load_dataset(self.dataset, src.hf_config, split=src.hf_split)
        # datasets raises many unrelated types (FileNotFoundError, ValueError, its own
        # DatasetNotFoundError, HTTP errors); all mean the job cannot read this source.
        except Exception as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            raise JobError(f"hf_dataset {self.name!r}: cannot load: {detail}") from None
        for index, row in enumerate(ds):
            yield SourceRow(index, row)

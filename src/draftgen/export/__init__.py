"""Training-ready files from a run directory: one module per format, `export_run` picks."""

from draftgen.export.base import ExportOptions
from draftgen.export.writing import ExportSummary, export_run

__all__ = ["ExportOptions", "ExportSummary", "export_run"]

"""draftgen: training datasets from self-hosted LLM servers, losslessly and at full speed."""

__version__ = "0.1.0"

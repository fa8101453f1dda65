"""The local engine of the demo, the tests and the benchmarks: a model we build ourselves
(tinymodel.py) served on 127.0.0.1 by the registry's CPU engine build (server.py)."""

from draftgen.local.server import EngineError, LocalEngine, find_free_port
from draftgen.local.tinymodel import build_tiny_model

__all__ = ["EngineError", "LocalEngine", "build_tiny_model", "find_free_port"]

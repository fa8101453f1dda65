"""The real local engine: a tiny model we build ourselves, served by an engine's CPU build."""

from draftgen.engine.local import EngineError, LocalEngine, find_free_port
from draftgen.engine.tinymodel import build_tiny_model

__all__ = ["EngineError", "LocalEngine", "build_tiny_model", "find_free_port"]

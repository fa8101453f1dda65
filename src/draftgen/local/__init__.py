"""The local engine of the demo, the tests and the benchmarks: a model made here — the real
SmolLM2-135M-Instruct from its package (smollm2.py), the tiny random-weight one
(tinymodel.py), or a 4-bit-rounded copy of either (rounded.py) — served on 127.0.0.1 by the
registry's CPU engine build (server.py)."""

from draftgen.local.server import EngineError, LocalEngine, find_free_port
from draftgen.local.tinymodel import build_tiny_model

__all__ = ["EngineError", "LocalEngine", "build_tiny_model", "find_free_port"]

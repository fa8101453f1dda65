"""The real model on the local CPU engine, as the integration tests start it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from draftgen.local import LocalEngine


def real_engine(model_dir: Path, log_path: Path, extra_args: Sequence[str] = ()
                ) -> LocalEngine:
    """The real model on the CPU engine, as the tests start it (2,048 positions: the
    tests' prompts and answers are short)."""
    return LocalEngine(model_dir, served_name="smollm2", max_model_len=2048, log_path=log_path,
                       extra_args=extra_args)

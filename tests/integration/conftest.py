"""Fixtures for tests against the real local engine (vLLM's CPU build serving the tiny model).

These tests fail, never skip, when the engine is missing: `make test` installs it, so a
missing engine is a broken setup that must be seen.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from draftgen.local import LocalEngine, build_tiny_model
from draftgen.local.tinymodel import build_rounded_model

_HERE = Path(__file__).resolve().parent
REPO_ROOT = _HERE.parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees every collected item, not only this folder's.
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTGEN_CACHE") or REPO_ROOT / ".cache")


@pytest.fixture(scope="session")
def engine_installed() -> None:
    missing = [m for m in ("vllm", "torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(
            f"integration tests need the local engine, but {', '.join(missing)} cannot be "
            f"imported by {sys.executable}; install it with `scripts/install-engine.sh VENV` "
            "(or `make test`, which does) and run pytest from that venv",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_tiny_model(cache_root() / "tiny-model")


@pytest.fixture(scope="session")
def rounded_model_dir(tiny_model_dir: Path) -> Path:
    """The tiny model with its weight matrices rounded to 4 bits: lossy on any machine."""
    return build_rounded_model(tiny_model_dir, cache_root() / "tiny-model-int4", bits=4)


@pytest.fixture(scope="session")
def local_engine(
    engine_installed: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalEngine]:
    log_path = tmp_path_factory.mktemp("engine") / "vllm.log"
    engine = LocalEngine(tiny_model_dir, kv_cache_gib=1, log_path=log_path)
    engine.start()
    pgid = engine.pid
    assert pgid is not None
    try:
        yield engine
    finally:
        engine.stop()
    # stop() must leave nothing of the engine behind, or later tests share 2 cores with it.
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)

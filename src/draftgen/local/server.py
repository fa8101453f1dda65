"""Start and stop a real CPU engine server on 127.0.0.1, for tests, the demo and benchmarks.

The engine is the registry's CPU build (`engines.registry.cpu_engine`), which
gives the argv and environment. The server gets its own process group, so one signal
reaches the API server and its engine core together, but stays in our session: this kernel
schedules CPU time per session (sched_autogroup), and an engine in a session of its own
starves a client in another.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from draftgen.engines.registry import cpu_engine
from draftgen.errors import DraftgenError
from draftgen.servers.process import (
    answers_chat,
    find_free_port,
    log_tail,
    reap_group,
    signal_group,
    terminate_group,
    wait_child,
)

__all__ = ["EngineError", "LocalEngine", "find_free_port"]

_POLL_INTERVAL_S = 0.5
# After the server process exits, its children get this long to follow before SIGKILL.
_GROUP_GRACE_S = 5.0


class EngineError(DraftgenError):
    """The local engine could not be started, or died while starting."""


class LocalEngine:
    """A CPU engine server for `model_dir`, owned by this process.

    `start()` returns only once a real one-token chat completion has succeeded, so the
    server is usable, not merely listening.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        port: int = 0,
        kv_cache_gib: int = 1,
        max_model_len: int = 4096,
        num_gpu_blocks_override: int | None = None,
        served_name: str = "tiny",
        log_path: Path | None = None,
        python: str = sys.executable,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        if kv_cache_gib < 1:
            raise ValueError("kv_cache_gib must be a whole number of GiB, at least 1")
        self.model_dir = Path(model_dir)
        self.port = port or find_free_port()
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.num_gpu_blocks_override = num_gpu_blocks_override
        self.served_name = served_name
        self.log_path = log_path
        self.python = python
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = cpu_engine()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _server(self) -> tuple[list[str], dict[str, str]]:
        server = self.engine.cpu_server(
            self.python, self.model_dir, served_name=self.served_name, port=self.port,
            max_model_len=self.max_model_len, num_blocks=self.num_gpu_blocks_override,
            kv_cache_gib=self.kv_cache_gib)
        assert server is not None, "cpu_engine() has a CPU build"
        return server

    def argv(self) -> list[str]:
        return [*self._server()[0], *self.extra_args]

    def env(self) -> dict[str, str]:
        return {**os.environ, **self._server()[1], **self.extra_env}

    def start(self, timeout_s: float = 180) -> None:
        if self._proc is not None:
            raise EngineError(f"engine already running (pid {self._proc.pid})")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{self.engine.name}-{self.port}-",
                                        suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.argv(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            process_group=0,
        )
        try:
            self._wait_until_ready(self._proc, timeout_s)
        except BaseException:
            # Also on Ctrl+C or a test timeout: never leave a half-started engine behind.
            self.stop()
            raise

    def _wait_until_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineError(
                    f"{self.engine.display_name} exited with code {code} while starting\n"
                    f"{self._log_tail()}"
                )
            # Checking the process again after the answer: a stale server on the same port
            # could answer while ours is failing to bind it.
            if self._answers_chat() and proc.poll() is None:
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.engine.display_name} did not answer a chat completion within "
                    f"{timeout_s:g} s\n"
                    f"{self._log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the group, SIGKILL it if the server has not exited after `timeout_s`."""
        proc = self._proc
        if proc is None:
            return
        # process_group=0 made the server's pid its group id.
        terminate_group(proc.pid, wait_child(proc), timeout_s=timeout_s,
                        grace_s=_GROUP_GRACE_S)
        if proc.poll() is None:
            proc.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash would."""
        proc = self._proc
        if proc is None:
            return
        self._signal_group(signal.SIGKILL)
        proc.wait()
        reap_group(proc.pid, _GROUP_GRACE_S)
        self._forget()

    def suspend(self) -> None:
        """Freeze the server: connections stay open but nothing answers (a hang)."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def __enter__(self) -> LocalEngine:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _answers_chat(self) -> bool:
        return answers_chat(self.url, self.served_name)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is not None:
            signal_group(self._proc.pid, sig)

    def _forget(self) -> None:
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self) -> str:
        return log_tail(self.log_path)

"""A gateway process draftgen starts and stops: in front of a run's launched workers, or of
a gateway profile's (`launch.py`)."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from draftgen.gateways.base import Gateway, GatewayError
from draftgen.gateways.registry import gateway_for
from draftgen.servers.process import (
    find_free_port,
    log_tail,
    port_in_use,
    process_start_ticks,
    terminate_group,
    wait_child,
)


class LaunchedGateway:
    """A gateway (the registry's default unless `gateway` says) draftgen starts in front of
    workers it launched: for a run (free ports of 127.0.0.1, stopped with the run) or from a
    gateway profile (`launch.py`: the profile's ports, left running for `serve --stop`). Port
    0 is a free port. It leads a process group of its own inside our session, like a
    launched server, so that another draftgen can stop it by its pid."""

    def __init__(self, worker_urls: Sequence[str], *, backend: str, log_path: Path,
                 python: str = sys.executable, host: str = "127.0.0.1", port: int = 0,
                 metrics_port: int = 0, gateway: Gateway | None = None) -> None:
        self.gateway = gateway_for() if gateway is None else gateway
        self.port = port or find_free_port()
        self.metrics_port = metrics_port or find_free_port()
        # A gateway bound to every interface is still reached on loopback from here.
        self._connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        bracketed = f"[{self._connect}]" if ":" in self._connect else self._connect
        self.url = f"http://{bracketed}:{self.port}"
        self.argv = self.gateway.command(python, host=host, port=self.port,
                                    metrics_port=self.metrics_port, worker_urls=worker_urls,
                                    backend=backend)
        self.log_path = log_path
        self.pid: int | None = None
        self.start_ticks: int | None = None
        self._workers = len(worker_urls)
        self._proc: subprocess.Popen[bytes] | None = None
        self._cancelled = threading.Event()

    def start(self, timeout_s: float = 120.0) -> None:
        """Start it and wait until it lists every worker as ready; a GatewayError with the
        log's tail if it exits, does not get there in `timeout_s` or is cancelled (`cancel`),
        and then it is stopped."""
        if port_in_use(self._connect, self.port):
            raise GatewayError(f"gateway port {self.port} is already in use by another process")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== draftgen: starting the gateway at "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(self.argv)}\n"
                          .encode())
                log.flush()
                self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, process_group=0)
        except OSError as e:
            raise GatewayError(
                f"cannot start the gateway ({self.argv[0]} -m {self.gateway.module}): "
                f"{e.strerror}; install draftgen[{self.gateway.extra}]") from None
        self.pid, self.start_ticks = self._proc.pid, process_start_ticks(self._proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._cancelled.is_set():
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()
                raise GatewayError(f"the gateway exited ({code}): {log_tail(self.log_path)}")
            with contextlib.suppress(OSError, ValueError, GatewayError):
                with urllib.request.urlopen(self.url + self.gateway.workers_path, timeout=5) as r:
                    listed = self.gateway.parse_workers(json.load(r), self.url)
                if sum(w.ready for w in listed) >= self._workers:
                    return
            time.sleep(0.5)
        self.stop()
        if self._cancelled.is_set():
            raise GatewayError("the gateway's start was cancelled")
        raise GatewayError(f"the gateway did not list its {self._workers} workers as ready "
                           f"within {timeout_s:g}s: {log_tail(self.log_path)}")

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running gateway, this process's child (only a parent can reap it)."""
        return self._proc

    def cancel(self) -> None:
        """Make a `start` waiting in another thread stop the gateway and give up."""
        self._cancelled.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM its process group, SIGKILL after `timeout_s`; nothing if it never ran."""
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate_group(proc.pid, wait_child(proc), timeout_s=timeout_s)

"""A gateway in front of many workers: the SGLang Model Gateway (`smg`), as draftgen reads it.

`GET /workers` lists every worker the gateway knows, with its URL, health and runtime; a
chat request carrying `x-smg-routing-key: K` goes, on a gateway started with `--policy
manual`, to the worker that key is pinned to (the first request with K pins it), and every
answer names the worker that served it in `x-smg-routed-worker-id`. draftgen addresses
each worker through the gateway by a key it has seen land there, and reads the served
worker from every answer: what a record names is where it was generated, whatever the
gateway did (a retry, a re-pinned key after a worker left or the gateway restarted).

Seen on smg 1.13.0 (tests/unit/servers/data/smg-1.13.0-workers.json is a recorded answer):
`x-smg-target-worker` is not honoured by its HTTP router (3 of 6 requests went elsewhere),
so routing keys are the way to address a worker.
"""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.errors import DraftgenError
from draftgen.servers.process import (
    find_free_port,
    log_tail,
    port_in_use,
    process_start_ticks,
    terminate_group,
    wait_child,
)

ROUTING_KEY_HEADER = "x-smg-routing-key"
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
WORKERS_PATH = "/workers"
# The release `serve` launches and the tests run (pyproject's `gateway` extra).
SMG_VERSION = "1.13.0"


class GatewayError(DraftgenError):
    """The gateway's answer cannot be read as a list of workers."""


@dataclass(frozen=True, slots=True)
class Worker:
    """One worker as the gateway lists it."""

    url: str
    id: str
    healthy: bool
    status: str
    runtime: str | None = None
    version: str | None = None
    model: str | None = None

    @property
    def ready(self) -> bool:
        """Healthy and not being drained or removed: it may take new work."""
        return self.healthy and self.status in ("ready", "")


def parse_workers(payload: Any, where: str) -> list[Worker]:
    """The workers of a `GET /workers` answer (`{"workers": [...]}`); a GatewayError naming
    `where` for anything else."""
    rows = payload.get("workers") if isinstance(payload, dict) else None
    if not isinstance(rows, list):
        raise GatewayError(f"{where}: not a gateway's worker list (no 'workers' array); is "
                           "this the SGLang Model Gateway?")
    out = []
    for i, row in enumerate(rows):
        url = row.get("url") if isinstance(row, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise GatewayError(f"{where}: workers[{i}] has no http(s) 'url'")
        labels = row.get("labels") if isinstance(row.get("labels"), dict) else {}
        out.append(Worker(
            url=url.rstrip("/"), id=str(row.get("id") or url),
            healthy=bool(row.get("is_healthy", False)), status=str(row.get("status") or ""),
            runtime=_str_or_none(row.get("runtime_type")),
            version=_str_or_none(labels.get("version")),
            model=_str_or_none(row.get("model_id")),
        ))
    return out


def gateway_command(python: str, *, host: str, port: int, metrics_port: int,
                    worker_urls: Sequence[str], backend: str) -> list[str]:
    """The argv of a gateway draftgen starts in front of its own workers.

    `--policy manual` pins each routing key to one worker (how draftgen addresses them);
    overload protection off, since draftgen's own admission keeps each worker near its KV
    capacity and the gateway's default (0.8 KV usage, 8 waiting) would send a key's request
    to another worker exactly when draftgen aims higher; retries stay on: a retried request
    still reaches draftgen as one answer, named by the worker that gave it. Its own metrics
    on `metrics_port` (smg's default, 29000 on every interface, collides with a second one).
    """
    return [python, "-m", "smg", "launch", "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--backend", backend, "--policy", "manual",
            "--disable-worker-overload-protection", "--worker-urls", *worker_urls]


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


class LaunchedGateway:
    """An `smg` draftgen starts in front of workers it launched: for a run (free ports of
    127.0.0.1, stopped with the run) or from a gateway profile (`servers/gateway_launch.py`:
    the profile's ports, left running for `serve --stop`). Port 0 is a free port. It leads a
    process group of its own inside our session, like a launched server, so that another
    draftgen can stop it by its pid."""

    def __init__(self, worker_urls: Sequence[str], *, backend: str, log_path: Path,
                 python: str = sys.executable, host: str = "127.0.0.1", port: int = 0,
                 metrics_port: int = 0) -> None:
        self.port = port or find_free_port()
        self.metrics_port = metrics_port or find_free_port()
        # A gateway bound to every interface is still reached on loopback from here.
        self._connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        bracketed = f"[{self._connect}]" if ":" in self._connect else self._connect
        self.url = f"http://{bracketed}:{self.port}"
        self.argv = gateway_command(python, host=host, port=self.port,
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
            raise GatewayError(f"cannot start the gateway ({self.argv[0]} -m smg): "
                               f"{e.strerror}; install draftgen[gateway]") from None
        self.pid, self.start_ticks = self._proc.pid, process_start_ticks(self._proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._cancelled.is_set():
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()
                raise GatewayError(f"the gateway exited ({code}): {log_tail(self.log_path)}")
            with contextlib.suppress(OSError, ValueError, GatewayError):
                with urllib.request.urlopen(self.url + WORKERS_PATH, timeout=5) as r:
                    listed = parse_workers(json.load(r), self.url)
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

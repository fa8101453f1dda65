"""A gateway in front of many workers: the SGLang Model Gateway (`smg`), as draftgen reads it.

`GET /workers` lists every worker the gateway knows, with its URL, health and runtime; a
chat request carrying `x-smg-routing-key: K` goes, on a gateway started with `--policy
manual`, to the worker that key is pinned to (the first request with K pins it), and every
answer names the worker that served it in `x-smg-routed-worker-id`. draftgen addresses
each worker through the gateway by a key it has seen land there, and reads the served
worker from every answer: what a record names is where it was generated, whatever the
gateway did (a retry, a re-pinned key after a worker left or the gateway restarted).

Seen on smg 1.13.0 (tests/unit/gateways/data/smg-1.13.0-workers.json is a recorded answer):
`x-smg-target-worker` is not honoured by its HTTP router (3 of 6 requests went elsewhere),
so routing keys are the way to address a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftgen.gateways.base import GatewayError, Worker

ROUTING_KEY_HEADER = "x-smg-routing-key"
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
WORKERS_PATH = "/workers"
# The release `serve` launches and the tests run (pyproject's `gateway` extra).
SMG_VERSION = "1.13.0"


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



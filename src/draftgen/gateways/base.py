"""The gateway contract: what draftgen needs of a router in front of many workers.

A run addresses each worker through the gateway by a routing key seen to land on it, reads
from every answer which worker served it, re-reads the worker list while it runs, and reads
the load (and settings) of a worker it cannot reach on its own URL from the gateway's
relayed metrics. `serve` and a job's `launch:` start one in front of launched workers.
A gateway implements `Gateway` in a folder of its own (`smg/`) and is one line in
`registry.py`; nothing outside this package names one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from draftgen.errors import DraftgenError

if TYPE_CHECKING:
    from draftgen.engines.base import Engine
    from draftgen.engines.info import ServerInfo
    from draftgen.engines.load import Reading
    from draftgen.servers.profile import ServerProfile


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



class Gateway(ABC):
    """One gateway, as draftgen drives it."""

    name: str
    # The release draftgen launches and is tested with, the module `python -m` starts, and
    # the extra of draftgen's that installs it.
    version: str
    module: str
    extra: str
    # A request with `routing_header: KEY` is pinned to one worker by its key; every answer
    # names the worker that served it in `served_header`.
    routing_header: str
    served_header: str
    # GET: the list of workers; every worker's metrics relayed in one page.
    workers_path: str
    metrics_path: str

    @abstractmethod
    def parse_workers(self, payload: Any, where: str) -> list[Worker]:
        """The workers of a `workers_path` answer; a GatewayError naming `where` else."""

    @abstractmethod
    def command(self, python: str, *, host: str, port: int, metrics_port: int,
                worker_urls: Sequence[str], backend: str) -> list[str]:
        """The argv of a gateway draftgen starts in front of its own workers."""

    @abstractmethod
    def worker_labels(self, payload: Any, url: str) -> dict[str, str] | None:
        """The labels a `workers_path` answer lists `url` with ({} when none); None when it
        does not list `url`."""

    @abstractmethod
    def worker_readings(self, text: str) -> dict[str, tuple[Reading, Engine | None]]:
        """Each worker's load fields in a `metrics_path` page, by worker URL."""

    @abstractmethod
    def relayed_info(self, url: str, metrics: str, labels: dict[str, str], *,
                     profile: ServerProfile | None = None) -> ServerInfo | None:
        """The settings of the worker at `url` as the gateway relays them; None when what it
        relays does not say."""

"""The SGLang Model Gateway (`smg`) as a `Gateway`: its API (`api.py`) and what it relays
of its workers (`metrics.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from draftgen.gateways.base import Gateway, Worker
from draftgen.gateways.smg import api, metrics

if TYPE_CHECKING:
    from draftgen.engines.base import Engine
    from draftgen.engines.info import ServerInfo
    from draftgen.engines.load import Reading
    from draftgen.servers.profile import ServerProfile


class Smg(Gateway):
    name = "smg"
    version = api.SMG_VERSION
    module = "smg"
    extra = "gateway"
    routing_header = api.ROUTING_KEY_HEADER
    served_header = api.ROUTED_WORKER_HEADER
    workers_path = api.WORKERS_PATH
    metrics_path = metrics.ENGINE_METRICS_PATH

    def parse_workers(self, payload: Any, where: str) -> list[Worker]:
        return api.parse_workers(payload, where)

    def command(self, python: str, *, host: str, port: int, metrics_port: int,
                worker_urls: Sequence[str], backend: str) -> list[str]:
        return api.gateway_command(python, host=host, port=port, metrics_port=metrics_port,
                                   worker_urls=worker_urls, backend=backend)

    def worker_labels(self, payload: Any, url: str) -> dict[str, str] | None:
        return metrics.worker_labels(payload, url)

    def worker_readings(self, text: str) -> dict[str, tuple[Reading, Engine | None]]:
        return metrics.worker_readings(text)

    def relayed_info(self, url: str, metrics_page: str, labels: dict[str, str], *,
                     profile: ServerProfile | None = None) -> ServerInfo | None:
        return metrics.relayed_info(url, metrics_page, labels, profile=profile)

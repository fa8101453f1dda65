"""What a worker draftgen reaches only through its gateway runs with, as the gateway relays
it: the worker's part of the relayed metrics page and its labels in the worker list."""

from __future__ import annotations

import aiohttp

from draftgen.engines.common import get_json, get_text
from draftgen.engines.info import ServerInfo, ServerInfoError
from draftgen.gateways.base import Gateway
from draftgen.gateways.registry import gateway_for
from draftgen.servers.info import bearer
from draftgen.servers.profile import ServerProfile


async def fetch_relayed_info(
    gateway: str,
    url: str,
    *,
    profile: ServerProfile | None = None,
    api_key: str | None = None,
    kind: Gateway | None = None,
) -> ServerInfo:
    """What the worker at `url`, reached only through `gateway`, runs with (smg: its
    `/engine_metrics` and `/workers`, see smg/metrics.py). Raises `ServerInfoError` when the
    gateway does not answer or list the worker, or what it relays does not say (an engine
    that keeps its settings out of its metrics)."""
    kind = gateway_for() if kind is None else kind
    base = gateway.rstrip("/")
    async with aiohttp.ClientSession(headers=bearer(api_key)) as session:
        metrics = await get_text(session, base + kind.metrics_path)
        workers = await get_json(session, base + kind.workers_path)
    labels = kind.worker_labels(workers, url)
    if labels is None:
        raise ServerInfoError(f"{base}{kind.workers_path} does not list {url}")
    info = kind.relayed_info(url, metrics or "", labels, profile=profile)
    if info is None:
        raise ServerInfoError(f"{url} does not answer on its own URL and what {base} relays "
                              f"of it ({kind.metrics_path}, {kind.workers_path}) does not say "
                              "what it runs with")
    return info

"""What a gateway relays of a worker draftgen cannot reach on its own URL (in a cluster often
only the gateway is reachable): its load and, where they say, its settings.

smg's `GET /engine_metrics` is every worker's own Prometheus page in one, each series
labelled `worker_addr="http://host:port"` (tests/unit/gateways/data/ has a recorded one).
Split by that label, a worker's part is read by the same engine reader as its own
`/metrics` (the registry's), so a load read through the gateway and one read from the
worker agree by construction. `GET /workers` lists each worker with labels (for vLLM:
`version`, `model_path`, `served_model_name`, `max_model_len`) that stand in for the
endpoints its settings are read from directly.

`GET /workers` also carries an `engine_load` per worker, in the shape of SGLang's
`/v1/loads`; for a vLLM worker smg 1.13.0 reports it as all zeros, capacity included, while
ten requests run there (smg-1.13.0-workers-busy.json): it is not read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from draftgen.engines.base import Engine
from draftgen.engines.common import as_int
from draftgen.engines.info import ServerInfo, WorkerFacts
from draftgen.engines.load import Reading, split_by_label
from draftgen.engines.registry import ENGINES, engine_for, metric_names, read_metrics

if TYPE_CHECKING:
    from draftgen.servers.profile import ServerProfile

ENGINE_METRICS_PATH = "/engine_metrics"
WORKER_LABEL = "worker_addr"


def worker_pages(text: str, *, wanted: frozenset[str] | None = None) -> dict[str, str]:
    """Each worker's own part of an `/engine_metrics` page, by worker URL; only the samples
    named in `wanted`, if given."""
    parts = split_by_label(text, WORKER_LABEL, wanted)
    return {url.rstrip("/"): page for url, page in parts.items()}


def worker_readings(text: str) -> dict[str, tuple[Reading, Engine | None]]:
    """Each worker's load fields in an `/engine_metrics` page, read as a poll of its own
    `/metrics` reads them, and the engine whose names its part uses; by worker URL."""
    out: dict[str, tuple[Reading, Engine | None]] = {}
    for url, page in worker_pages(text, wanted=metric_names()).items():
        try:
            out[url] = read_metrics(page)
        except ValueError:  # the parser's only complaint about malformed lines
            out[url] = ({}, None)
    return out


def worker_labels(payload: Any, url: str) -> dict[str, str] | None:
    """The labels a `GET /workers` answer lists `url` with ({} when it has none); None when
    it does not list `url`."""
    rows = payload.get("workers") if isinstance(payload, dict) else None
    for row in rows if isinstance(rows, list) else ():
        if isinstance(row, dict) and str(row.get("url") or "").rstrip("/") == url:
            labels = row.get("labels")
            return ({str(k): str(v) for k, v in labels.items()}
                    if isinstance(labels, dict) else {})
    return None


def relayed_info(url: str, engine_metrics: str, labels: dict[str, str], *,
                 profile: ServerProfile | None = None) -> ServerInfo | None:
    """The settings of the worker at `url` as the gateway relays them (its part of
    `engine_metrics`, its `labels`); None when they do not say."""
    page = worker_pages(engine_metrics).get(url)
    if page is None:
        return None
    facts = worker_facts(labels)
    candidates = [engine_for(profile.engine)] if profile is not None else ENGINES.values()
    for engine in candidates:
        if (info := engine.gateway_info(url, page, facts, profile=profile)) is not None:
            return info
    return None


def worker_facts(labels: dict[str, str]) -> WorkerFacts:
    """smg 1.13.0 lists a vLLM worker with the `version`, `served_model_name`, `model_path`
    and `max_model_len` it read from the worker (tests/unit/gateways/data/
    smg-1.13.0-workers.json)."""
    return WorkerFacts(version=labels.get("version"),
                       served_name=labels.get("served_model_name"),
                       model_path=labels.get("model_path"),
                       context_length=as_int(labels.get("max_model_len")))

"""A Prometheus endpoint for a run: `draftgen run --metrics-port PORT`.

The exporter holds the latest frozen `Snapshot` (plus per-server load and the scheduler's
targets) and turns it into metric families when scraped, so the run loop only swaps a
reference and the scrape, on the HTTP server's thread, never sees a half-updated state.
It has a registry of its own: nothing registered globally by another library leaks into
draftgen's endpoint, and tests can start several exporters in one process.

Exposed (all prefixed `draftgen_`):

    requests_total{status}                done | failed | retried (counter)
    samples{category, state}              planned | done | failed | truncated | pending
    output_tokens_total                   output tokens of done samples (counter)
    in_flight                             requests in flight now
    output_tokens_per_second              over the last minute
    eta_seconds                           absent until there is a rate to divide by
    elapsed_seconds
    server_up{server}                     1 up, 0 down
    server_kv_capacity_tokens{server}
    server_kv_usage_ratio{server}         0..1
    server_running{server}, server_waiting{server}
    server_in_flight{server}              draftgen's requests to it
    server_target{server}                 the scheduler's target for that server
    scheduler_target{partition}
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from draftgen.running.stats import Snapshot

SAMPLE_STATES = ("planned", "done", "failed", "truncated", "pending")
# Per-server fields, with the names `ServerSnapshot` and the load poller use as aliases.
_SERVER_FIELDS: dict[str, tuple[str, ...]] = {
    "up": ("up",),
    "kv_capacity_tokens": ("kv_capacity_tokens", "capacity", "kv_tokens"),
    "kv_usage_ratio": ("kv_usage_ratio", "kv_usage"),
    "running": ("running",),
    "waiting": ("waiting",),
    "in_flight": ("in_flight",),
    "target": ("target",),
}
_SERVER_HELP = {
    "up": "1 when the server takes requests, 0 while it is down",
    "kv_capacity_tokens": "KV cache capacity of the server in tokens",
    "kv_usage_ratio": "Share of the server's KV cache in use (0-1)",
    "running": "Requests the server is decoding",
    "waiting": "Requests queued at the server",
    "in_flight": "draftgen requests in flight to the server",
    "target": "The scheduler's current target for the server",
}


@dataclass(frozen=True, slots=True)
class _State:
    snapshot: Snapshot | None = None
    servers: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    targets: Mapping[str, float] = field(default_factory=dict)


class _RunCollector(Collector):
    def __init__(self) -> None:
        self.state = _State()

    def collect(self) -> Iterator[Metric]:
        state = self.state  # one read: update() replaces it whole
        snap = state.snapshot
        if snap is not None:
            yield from _run_metrics(snap)
        yield from _server_metrics(_merged_servers(snap, state.servers))
        target = GaugeMetricFamily("draftgen_scheduler_target",
                                   "The scheduler's current target per partition",
                                   labels=["partition"])
        for part, value in sorted(state.targets.items()):
            target.add_metric([part], float(value))
        yield target


def _run_metrics(snap: Snapshot) -> Iterator[Metric]:
    req = CounterMetricFamily("draftgen_requests", "Requests by outcome", labels=["status"])
    req.add_metric(["done"], snap.total("done"))
    req.add_metric(["failed"], snap.total("failed"))
    req.add_metric(["retried"], snap.retries)
    yield req
    samples = GaugeMetricFamily("draftgen_samples", "Samples by category and state",
                                labels=["category", "state"])
    for c in snap.categories:
        for state in SAMPLE_STATES:
            samples.add_metric([c.name, state], float(getattr(c, state)))
    yield samples
    yield CounterMetricFamily("draftgen_output_tokens", "Output tokens of done samples",
                              value=snap.total("output_tokens"))
    yield GaugeMetricFamily("draftgen_in_flight", "Requests in flight", value=snap.in_flight)
    yield GaugeMetricFamily("draftgen_output_tokens_per_second",
                            "Output tokens per second over the last minute",
                            value=snap.tok_s_window)
    yield GaugeMetricFamily("draftgen_elapsed_seconds", "Seconds since the run started",
                            value=snap.elapsed_s)
    if snap.eta_s is not None:
        yield GaugeMetricFamily("draftgen_eta_seconds", "Estimated seconds to finish",
                                value=snap.eta_s)


def _merged_servers(snap: Snapshot | None, extra: Mapping[str, Mapping[str, float]],
                    ) -> dict[str, dict[str, float]]:
    """Per-server values from the snapshot, overridden by the explicit mapping."""
    merged: dict[str, dict[str, float]] = {}
    for s in getattr(snap, "servers", ()) or ():
        merged[s.url] = _pick(lambda k, s=s: getattr(s, k, None))
    for url, values in extra.items():
        merged.setdefault(url, {}).update(_pick(values.get))
    return merged


def _pick(get: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, aliases in _SERVER_FIELDS.items():
        for alias in aliases:
            v = get(alias)
            if v is not None:
                out[name] = float(v)
                break
    return out


def _server_metrics(servers: Mapping[str, Mapping[str, float]]) -> Iterator[Metric]:
    for name, help_text in _SERVER_HELP.items():
        fam = GaugeMetricFamily(f"draftgen_server_{name}", help_text, labels=["server"])
        for url, values in sorted(servers.items()):
            if name in values:
                fam.add_metric([url], values[name])
        yield fam


class MetricsExporter:
    """Serves the run's metrics over HTTP until `stop()`.

        exporter = MetricsExporter()
        port = exporter.start(9400)          # 0 picks a free port
        exporter.update(stats.snapshot())    # as often as progress refreshes
        exporter.stop()
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _RunCollector()
        self.registry.register(self._collector)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def update(self, snapshot: Snapshot, servers: Mapping[str, Mapping[str, float]] | None = None,
               targets: Mapping[str, float] | None = None) -> None:
        """Publish a new state; `servers` maps URL -> {kv_capacity_tokens, kv_usage_ratio,
        running, waiting, ...} and adds to (or overrides) what the snapshot says."""
        self._collector.state = _State(snapshot, dict(servers or {}), dict(targets or {}))

    def start(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        if self._server is not None:
            raise RuntimeError("metrics exporter already started")
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        actual: int = self._server.server_port
        return actual

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["MetricsExporter"]

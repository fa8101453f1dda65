"""The Prometheus endpoint, scraped over real HTTP and parsed with prometheus_client."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from draftgen.clock import FakeClock
from draftgen.running.metrics import MetricsExporter
from draftgen.running.stats import RunStats, Snapshot
from draftgen.sample import Failure, Record, Turn


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def record(cat: str, tokens: int, finish: str = "stop") -> Record:
    turn = Turn("x", None, finish, 5, tokens, 0.1, 1.0)
    return Record(f"{cat}-{tokens}", "fp", cat, "short", (), (), (turn,), "http://s", 1, 0.0)


def snapshot() -> Snapshot:
    clock = FakeClock()
    stats = RunStats(clock)
    stats.plan("chat", planned=10)
    stats.plan("code", planned=4)
    stats.eta_view = lambda: 95.0
    stats.already("chat", done=2, failed=0, truncated=0, output_tokens=50)
    for cat in ("chat", "chat", "code"):
        stats.started(cat)
    stats.finished(record("chat", 30))
    stats.finished(record("chat", 100, finish="length"))
    stats.finished(Failure("code-1", "fp", "code", "short", "bad_request", "no", 1, "s", 0.0))
    stats.started("code")
    stats.retried()
    for _ in range(130):
        stats.token()
    clock.advance(10)
    return stats.snapshot()


def test_scrape_shows_requests_samples_tokens_servers_and_targets() -> None:
    snap = snapshot()
    with MetricsExporter() as exporter:
        port = exporter.start(0)
        assert port > 0
        exporter.update(
            snap,
            servers={"http://a:8000": {"kv_capacity_tokens": 8192, "kv_usage_ratio": 0.5,
                                       "running": 11, "waiting": 2},
                     "http://b:8000": {"capacity": 2048, "kv_usage": 1.0}},
            targets={"short": 20, "long": 4})
        m = scrape(port)
    assert m[("draftgen_requests_total", (("status", "done"),))] == 4
    assert m[("draftgen_requests_total", (("status", "failed"),))] == 1
    assert m[("draftgen_requests_total", (("status", "retried"),))] == 1
    assert m[("draftgen_samples", (("category", "chat"), ("state", "planned")))] == 10
    assert m[("draftgen_samples", (("category", "chat"), ("state", "done")))] == 4
    assert m[("draftgen_samples", (("category", "chat"), ("state", "truncated")))] == 1
    assert m[("draftgen_samples", (("category", "chat"), ("state", "pending")))] == 6
    assert m[("draftgen_samples", (("category", "code"), ("state", "failed")))] == 1
    assert m[("draftgen_output_tokens_total", ())] == 180
    assert m[("draftgen_in_flight", ())] == 1
    assert m[("draftgen_output_tokens_per_second", ())] == pytest.approx(13.0)
    assert m[("draftgen_eta_seconds", ())] == pytest.approx(snap.eta_s)
    assert m[("draftgen_server_kv_capacity_tokens", (("server", "http://a:8000"),))] == 8192
    assert m[("draftgen_server_kv_capacity_tokens", (("server", "http://b:8000"),))] == 2048
    assert m[("draftgen_server_kv_usage_ratio", (("server", "http://b:8000"),))] == 1.0
    assert m[("draftgen_server_running", (("server", "http://a:8000"),))] == 11
    assert m[("draftgen_server_waiting", (("server", "http://a:8000"),))] == 2
    assert ("draftgen_server_running", (("server", "http://b:8000"),)) not in m
    assert m[("draftgen_scheduler_target", (("partition", "short"),))] == 20
    assert m[("draftgen_scheduler_target", (("partition", "long"),))] == 4


def test_stop_closes_the_port_and_a_new_exporter_starts_fresh() -> None:
    exporter = MetricsExporter()
    port = exporter.start(0)
    before = scrape(port)
    assert not any(name.startswith("draftgen_requests") for name, _ in before)
    exporter.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    exporter.stop()  # a second stop is harmless


def test_exporters_have_their_own_registries() -> None:
    with MetricsExporter() as a, MetricsExporter() as b:
        pa, pb = a.start(0), b.start(0)
        a.update(snapshot())
        assert ("draftgen_in_flight", ()) in scrape(pa)
        assert ("draftgen_in_flight", ()) not in scrape(pb)
        # Nothing from the process-wide default registry (python_info, process_*) leaks in.
        assert all(name.startswith("draftgen_") for name, _ in scrape(pa))


def test_starting_twice_is_an_error() -> None:
    with MetricsExporter() as e:
        e.start(0)
        with pytest.raises(RuntimeError):
            e.start(0)


def test_eta_is_absent_until_known() -> None:
    clock = FakeClock()
    stats = RunStats(clock)
    stats.plan("chat", planned=3)
    snap = stats.snapshot()
    assert snap.eta_s is None
    with MetricsExporter() as e:
        port = e.start(0)
        e.update(snap)
        assert ("draftgen_eta_seconds", ()) not in scrape(port)


def test_server_load_in_the_snapshot_is_exported() -> None:
    import dataclasses

    from draftgen.running.stats import ServerSnapshot as server_snapshot

    snap = dataclasses.replace(snapshot(), servers=(
        server_snapshot(url="http://a", up=True, in_flight=3, capacity=8192, kv_usage=0.25,
                        running=2, waiting=1, target=5000.0),
        server_snapshot(url="http://b", up=False, in_flight=0)))
    with MetricsExporter() as e:
        port = e.start(0)
        e.update(snap, servers={"http://b": {"running": 0}})
        m = scrape(port)
    a, b = (("server", "http://a"),), (("server", "http://b"),)
    assert m[("draftgen_server_up", a)] == 1
    assert m[("draftgen_server_up", b)] == 0
    assert m[("draftgen_server_kv_capacity_tokens", a)] == 8192
    assert m[("draftgen_server_kv_usage_ratio", a)] == 0.25
    assert m[("draftgen_server_in_flight", a)] == 3
    assert m[("draftgen_server_target", a)] == 5000
    assert m[("draftgen_server_running", b)] == 0

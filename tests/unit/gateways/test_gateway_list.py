"""Reading a gateway's worker list (an answer recorded from smg 1.13.0) and the job's
`gateway:` entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from draftgen.gateways.base import GatewayError
from draftgen.gateways.smg.api import parse_workers
from draftgen.job import Server

RECORDED = Path(__file__).parent / "data" / "smg-1.13.0-workers.json"


def test_the_recorded_worker_list_reads_as_two_ready_vllm_workers() -> None:
    workers = parse_workers(json.loads(RECORDED.read_text()), "gw/workers")
    assert len(workers) == 2
    assert all(w.ready and w.runtime == "vllm" and w.version == "0.32.0" and w.model == "tiny"
               for w in workers)
    assert all(w.url.startswith("http://127.0.0.1:") and not w.url.endswith("/")
               for w in workers)
    assert len({w.id for w in workers}) == 2


@pytest.mark.parametrize(("healthy", "status", "ready"), [
    (True, "ready", True), (False, "ready", False), (True, "draining", False),
    (True, "pending", False),
])
def test_only_a_healthy_ready_worker_takes_work(healthy: bool, status: str, ready: bool) -> None:
    row = {"url": "http://w:1/", "id": "x", "is_healthy": healthy, "status": status}
    (w,) = parse_workers({"workers": [row]}, "gw")
    assert w.ready is ready
    assert w.url == "http://w:1"


@pytest.mark.parametrize(("payload", "says"), [
    ({"data": []}, "no 'workers' array"),
    ([], "no 'workers' array"),
    ({"workers": [{"id": "x"}]}, "workers[0] has no http(s) 'url'"),
    ({"workers": [{"url": "w:1"}]}, "workers[0] has no http(s) 'url'"),
])
def test_an_answer_that_is_not_a_worker_list_names_what_is_wrong(payload: object,
                                                                   says: str) -> None:
    with pytest.raises(GatewayError, match=r"^gw/workers: .*" + says.replace("[", r"\[")
                       .replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        parse_workers(payload, "gw/workers")


def test_a_server_entry_is_exactly_one_of_url_gateway_or_launch() -> None:
    assert Server(gateway="http://gw:30000/").gateway == "http://gw:30000"
    assert Server(gateway="http://gw:1", profile="p.yaml").profile == "p.yaml"
    assert Server(workers=["a.yaml", "b.yaml"]).workers == ["a.yaml", "b.yaml"]
    for bad in ({"gateway": "http://gw:1", "url": "http://s:1"},
                {"gateway": "http://gw:1", "launch": "p.yaml"},
                {"workers": ["a.yaml"], "launch": "p.yaml"}, {}):
        with pytest.raises(ValidationError, match="exactly one of 'url', 'gateway', 'launch' "
                                                  "or 'workers'"):
            Server(**bad)
    with pytest.raises(ValidationError, match="'workers' already name their profiles"):
        Server(workers=["a.yaml"], profile="p.yaml")
    with pytest.raises(ValidationError, match="at least 1 item"):
        Server(workers=[])
    with pytest.raises(ValidationError, match="must start with http"):
        Server(gateway="gw:1")

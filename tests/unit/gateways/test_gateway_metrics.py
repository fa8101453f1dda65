"""A worker's load and settings read through the gateway's /engine_metrics agree with what
its own /metrics says: both go through the same engine reader. On real answers of smg 1.13.0
and the vLLM worker behind it (data/README.md says how they were recorded)."""

from __future__ import annotations

import json
from pathlib import Path

from draftgen.engines.load import server_load
from draftgen.engines.registry import read_metrics
from draftgen.engines.vllm.info import parse_info
from draftgen.gateways.smg.metrics import (
    relayed_info,
    worker_labels,
    worker_pages,
    worker_readings,
)

DATA = Path(__file__).parent / "data"
WORKER = "http://127.0.0.1:50905"
GAUGES = ("kv_capacity_tokens", "kv_used_tokens", "kv_usage", "running", "waiting",
          "kv_block_tokens")


def data(name: str) -> str:
    return (DATA / name).read_text()


def test_a_busy_workers_load_through_the_gateway_is_its_own() -> None:
    through = worker_readings(data("smg-1.13.0-engine_metrics.txt"))
    assert set(through) == {WORKER}
    reading, engine = through[WORKER]
    own, own_engine = read_metrics(data("vllm-0.32.0-metrics.txt"))
    assert engine is own_engine and engine is not None and engine.name == "vllm"
    via, direct = (server_load(WORKER, 0.0, r, "") for r in (reading, own))
    assert via.running == 10 and via.kv_capacity_tokens == 4096 and via.kv_block_tokens == 128
    assert 0.6 < (via.kv_usage or 0) < 0.7
    assert via.missing == direct.missing == ()
    for f in GAUGES:
        assert getattr(via, f) == getattr(direct, f), f
    # The worker was read ~20 ms after the gateway: its counters ran on a little.
    for f in ("generation_tokens_total", "engine_steps_total"):
        assert 0 < getattr(via, f) <= getattr(direct, f) <= getattr(via, f) * 1.02, f
    assert via.preemptions_total == direct.preemptions_total == 0


def test_at_rest_every_field_agrees() -> None:
    through = worker_readings(data("smg-1.13.0-engine_metrics-settled.txt"))[WORKER]
    own = read_metrics(data("vllm-0.32.0-metrics-settled.txt"))
    assert through == own
    assert through[0]["generation_tokens_total"] == 3001


def test_each_worker_has_its_own_reading_not_a_sum_or_a_max() -> None:
    real = data("smg-1.13.0-engine_metrics.txt")
    # A second worker: the recorded page relabelled, with 3 running and its own capacity.
    other = (real.replace(WORKER, "http://10.0.0.2:8000")
             .replace(',worker_addr="http://10.0.0.2:8000"} 10\n',
                      ',worker_addr="http://10.0.0.2:8000"} 3\n')
             .replace('num_gpu_blocks="32"', 'num_gpu_blocks="64"')
             .replace('kv_cache_size_tokens="4096"', 'kv_cache_size_tokens="8192"'))
    both = worker_readings(real + other)
    assert set(both) == {WORKER, "http://10.0.0.2:8000"}
    assert both[WORKER][0]["running"] == 10
    assert both["http://10.0.0.2:8000"][0]["running"] == 3
    assert both["http://10.0.0.2:8000"][0]["kv_capacity_tokens"] == 8192
    assert both[WORKER][0]["kv_capacity_tokens"] == 4096


def test_lines_without_the_worker_label_are_left_out() -> None:
    page = ('vllm:num_requests_running{engine="0"} 4\n'
            'vllm:num_requests_running{note="worker_addr=\\"x\\"",engine="0"} 5\n'
            'vllm:num_requests_running{engine="0",worker_addr="http://w:1/"} 6\n'
            '# worker_addr="http://w:2"\n')
    assert worker_pages(page) == {
        "http://w:1": 'vllm:num_requests_running{engine="0",worker_addr="http://w:1/"} 6\n'}
    assert worker_readings(page)["http://w:1"][0]["running"] == 6


def test_settings_relayed_by_the_gateway_are_those_the_worker_gives() -> None:
    workers = json.loads(data("smg-1.13.0-workers-busy.json"))
    labels = worker_labels(workers, WORKER)
    assert labels is not None and labels["version"] == "0.32.0"
    via = relayed_info(WORKER, data("smg-1.13.0-engine_metrics.txt"), labels)
    assert via is not None
    # What a direct read gets from /metrics, /version and /v1/models of the same worker.
    direct = parse_info(WORKER, data("vllm-0.32.0-metrics.txt"), version="0.32.0",
                        models={"data": [{"id": "tiny", "root": ".cache/tiny-model",
                                          "max_model_len": 1024}]})
    assert via.identity() == direct.identity()
    assert via.configuration() == direct.configuration()
    assert (via.engine, via.kv_tokens, via.context_length, via.kv_dtype_setting) == (
        "vllm", 4096, 1024, "auto")
    assert worker_labels(workers, "http://elsewhere:1") is None


def test_settings_the_gateway_does_not_relay_are_unknown() -> None:
    page = data("smg-1.13.0-engine_metrics.txt")
    without_cache_info = "\n".join(line for line in page.splitlines()
                                   if "cache_config_info" not in line)
    assert relayed_info(WORKER, without_cache_info, {}) is None
    assert relayed_info("http://other:1", page, {}) is None


def test_the_workers_engine_load_stays_zero_while_requests_run() -> None:
    """Why the load is read from /engine_metrics: smg 1.13.0's `engine_load` (and
    /get_loads) for a vLLM worker says nothing, capacity included, with 10 running."""
    row = json.loads(data("smg-1.13.0-workers-busy.json"))["workers"][0]
    assert row["load"] == 10  # the gateway's own count of requests it has open there
    loads = [row["engine_load"]["loads"][0],
             json.loads(data("smg-1.13.0-get_loads.json"))["loads"][0]]
    for entry in loads:
        assert entry["num_running_reqs"] == entry["max_total_num_tokens"] == 0
    assert worker_readings(data("smg-1.13.0-engine_metrics.txt"))[WORKER][0]["running"] == 10

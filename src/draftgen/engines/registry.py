"""The engines by name: what a profile's `engine:` may say, and the readers that ask each
engine in turn when a URL comes with no label (server info, load, scoring).

A new engine is one folder beside `sglang/` and `vllm/` implementing `base.Engine`, and
one line here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from draftgen.engines.base import Engine
from draftgen.engines.info import ServerInfoError
from draftgen.engines.load import MetricNames, Reading, read_prometheus
from draftgen.engines.scoring import Http, ProbeError, ScoringServer
from draftgen.engines.sglang.engine import SGLang
from draftgen.engines.vllm.engine import VLLM

# In the order a URL with no label is asked: an engine with an endpoint of its own first.
ENGINES: dict[str, Engine] = {e.name: e for e in (SGLang(), VLLM())}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def engine_for(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ServerInfoError(f"unknown engine {name!r}; known: {sorted(ENGINES)}") from None


def cpu_engine() -> Engine:
    """The engine whose CPU build serves the tiny model for the demo and the tests."""
    return next(e for e in ENGINES.values() if e.cpu_kv_env is not None)


def with_feature(feature: str) -> list[Engine]:
    """The engines that have a profile feature (`Engine.features`)."""
    return [e for e in ENGINES.values() if feature in e.features]


@cache
def _metric_tables() -> tuple[tuple[MetricNames, ...], frozenset[str]]:
    tables = tuple(e.metrics for e in ENGINES.values() if e.metrics is not None)
    return tables, frozenset().union(*(t.wanted() for t in tables))


def metric_tables() -> Sequence[MetricNames]:
    return _metric_tables()[0]


def metric_names() -> frozenset[str]:
    """Every sample name a load reading uses, whichever engine."""
    return _metric_tables()[1]


def read_metrics(text: str) -> tuple[Reading, Engine | None]:
    """The load fields of a Prometheus page, and the engine whose names it uses."""
    tables, wanted = _metric_tables()
    reading, table = read_prometheus(text, tables, wanted)
    return reading, (None if table is None else ENGINES[table.engine])


def read_metrics_body(body: bytes) -> tuple[Reading, Engine | None]:
    try:
        return read_metrics(body.decode("utf-8", "replace"))
    except ValueError:  # the parser's only complaint about malformed lines
        return {}, None


async def scoring_server(http: Http, url: str, model: str | None) -> ScoringServer:
    """The probe's scorer for whichever engine serves `url`."""
    url = url.rstrip("/")
    for engine in ENGINES.values():
        found = await engine.scorer(http, url, model)
        if found is not None:
            return found
    raise ProbeError(f"{url} answers like no known engine")

"""What a server says about its own load: KV capacity and usage, queue, preemptions.

One `LoadPoller` per server URL. On its first answer it finds out which endpoint the server
has, asking the engines of the registry (`engines/`) in this order, and then keeps
asking only that one:

- an engine's JSON load endpoint (`Engine.loads_path`, e.g. one entry per DP rank, summed).
  Such an endpoint may lack cumulative counters (a gauge of the last retraction, not a
  running count), so when `/metrics` also answers they are read from there as well.
- `GET /metrics` in Prometheus text, by each engine's `MetricNames`. Series are
  deduplicated per DP rank / engine (tensor- and pipeline-parallel ranks repeat the same
  gauge) and summed across them.
- an engine's server-info endpoint (`Engine.info_paths`): capacity only.

A field the server does not publish is None and named in `ServerLoad.missing`; the poller
says so through `log` once per distinct set of missing fields, not on every poll. A server
that does not answer at all gives None; HTTP errors and unparseable bodies give a reading
with the fields missing, never an exception, so a polling loop needs no guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import aiohttp

from draftgen.clock import Clock
from draftgen.engines.base import Engine
from draftgen.engines.load import (
    COUNTERS,
    Reading,
    ServerLoad,
    parse_json,
    put_usage,
    server_load,
)
from draftgen.engines.registry import ENGINES, read_metrics_body


@dataclass(frozen=True)
class _Plan:
    """Which endpoint answers: an engine's load endpoint, its /metrics, its server info."""

    kind: Literal["loads", "metrics", "info", "none"]
    engine: Engine | None = None

    @property
    def source(self) -> str:
        if self.engine is None:
            return "no load endpoint"
        path = {"loads": self.engine.loads_path, "metrics": "/metrics",
                "info": (self.engine.info_paths or ("",))[0]}[self.kind]
        return f"{self.engine.name} {path}"


_NONE = _Plan("none")


class _NoAnswer(Exception):
    """The server did not answer: refused, reset, or timed out."""


class LoadPoller:
    """Polls one server's load; one `poll()` at a time."""

    def __init__(self, session: aiohttp.ClientSession, url: str, *, clock: Clock,
                 timeout_s: float = 5.0, log: Callable[[str], None] | None = None) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._log = log
        self._plan: _Plan | None = None
        # False while the answer may still change: nothing found yet, or /v1/loads failed
        # with a server error (SGLang answers 503 while it starts).
        self._settled = False
        # SGLang /v1/loads lacks cumulative counters; its /metrics has them when enabled.
        self._metrics_too = False
        self._info_capacity: float | None = None
        self._info_tried = False
        self._logged: set[tuple[str, ...]] = set()
        # Why the last poll got no answer (None after one that did), and whether nothing
        # was listening: a server that stops listening is on its way out.
        self.failure: str | None = None
        self.refused = False

    @property
    def source(self) -> str | None:
        """The endpoint found so far, or None before the server first answered."""
        return None if self._plan is None else self._plan.source

    async def poll(self) -> ServerLoad | None:
        at = self._clock.monotonic()
        try:
            if not self._settled:
                await self._detect()
            found = await self._read()
            if found is None:  # the endpoint went away: another server answers there now
                await self._detect()
                found = await self._read() or ({}, f"{self.source} (gone)")
        except _NoAnswer as e:
            self.failure = str(e) or type(e.__cause__).__name__
            self.refused = isinstance(e.__cause__, aiohttp.ClientConnectorError)
            return None
        self.failure, self.refused = None, False
        load = server_load(self.url, at, *found)
        if load.missing and load.missing not in self._logged:
            self._logged.add(load.missing)
            self._say(f"{self.url}: load from {load.source} lacks {', '.join(load.missing)}")
        return load

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log(message)

    async def _get(self, path: str, accept: str) -> tuple[int, bytes]:
        try:
            # Accept overrides a client session's event-stream default; text/plain also
            # keeps a Prometheus endpoint from switching to OpenMetrics.
            async with self._session.get(self.url + path, timeout=self._timeout,
                                         headers={"Accept": accept}) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise _NoAnswer(str(e)) from e

    async def _detect(self) -> None:
        plan = _NONE
        self._metrics_too = False
        self._info_tried = False
        self._settled = True
        for engine in ENGINES.values():
            if engine.loads_path is None:
                continue
            status, body = await self._get(engine.loads_path, "application/json")
            self._settled = self._settled and status < 500
            if status == 200 and engine.read_loads(parse_json(body)) is not None:
                plan = _Plan("loads", engine)
                status, body = await self._get("/metrics", "text/plain")
                reading = read_metrics_body(body)[0] if status == 200 else {}
                self._metrics_too = any(f in reading for f in COUNTERS)
                break
        if plan.kind == "none":
            status, body = await self._get("/metrics", "text/plain")
            paged = read_metrics_body(body)[1] if status == 200 else None
            if paged is not None:
                plan = _Plan("metrics", paged)
            else:
                for engine in ENGINES.values():
                    if (await self._server_info(engine))[1] is not None:
                        plan = _Plan("info", engine)
                        break
        self._settled = self._settled and plan.kind != "none"
        if plan != self._plan:
            extra = " + /metrics" if self._metrics_too else ""
            self._say(f"{self.url}: load from {plan.source}{extra}")
        self._plan = plan

    async def _server_info(self, engine: Engine) -> tuple[int, float | None]:
        """Status of the engine's first server-info path that exists (else 404), and its
        capacity."""
        status, body = 404, b""
        for path in engine.info_paths:
            status, body = await self._get(path, "application/json")
            if status != 404:
                break
        return status, engine.info_capacity(parse_json(body)) if status == 200 else None

    async def _read(self) -> tuple[Reading, str] | None:
        """This poll's reading and its source; None when the endpoint is gone (404)."""
        plan = self._plan
        assert plan is not None
        source = plan.source
        if plan.engine is None:
            return {}, source
        if plan.kind == "info":
            status, capacity = await self._server_info(plan.engine)
            if status == 404:
                return None
            if status != 200:
                source += f" (HTTP {status})"
            return ({} if capacity is None else {"kv_capacity_tokens": capacity}), source
        json = plan.kind == "loads"
        path = plan.engine.loads_path if json else "/metrics"
        assert path is not None
        status, body = await self._get(path, "application/json" if json else "text/plain")
        if status == 404:
            return None
        if status != 200:
            return {}, f"{source} (HTTP {status})"
        if not json:
            reading = read_metrics_body(body)[0]
            if plan.engine.info_paths and "kv_capacity_tokens" not in reading:
                source += await self._add_info_capacity(plan.engine, reading)
            return reading, source
        reading = plan.engine.read_loads(parse_json(body)) or {}
        if self._metrics_too:
            try:
                status, body = await self._get("/metrics", "text/plain")
            except _NoAnswer:  # the server did answer; keep what the load endpoint said
                status = 0
            if status == 200:
                counters = read_metrics_body(body)[0]
                reading.update({f: counters[f] for f in COUNTERS if f in counters})
                source += " + /metrics"
        return reading, source

    async def _add_info_capacity(self, engine: Engine, reading: Reading) -> str:
        """Capacity from the server info, asked once: it does not change while a server runs."""
        if not self._info_tried:
            self._info_tried = True
            self._info_capacity = (await self._server_info(engine))[1]
        if self._info_capacity is None:
            return ""
        reading["kv_capacity_tokens"] = self._info_capacity
        if "kv_usage" not in reading:
            put_usage(reading, None)
        return f" + {engine.info_paths[0]}"

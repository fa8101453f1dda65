"""The load of workers draftgen reaches only through their gateway (a cluster where only
the gateway is reachable), read from the gateway's relayed metrics page (smg:
`GET /engine_metrics`).

One `GatewayLoads` per gateway: one read of its page serves every worker of it polled in
the same round (a read in flight is joined, one started less than `FRESH_S` ago is
reused), and each worker's part is read by the same engine reader as a poll of its own
`/metrics` (gateways/smg/metrics.py). `RelayedPoller` is one worker's view of it, with
`LoadPoller`'s surface. Its `refused` is never set: such a worker is alive while its
gateway lists it as ready (running/gateways.py reads the list), not while a port of its
own answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from draftgen.clock import Clock
from draftgen.engines.base import Engine
from draftgen.engines.load import Reading, ServerLoad, server_load
from draftgen.gateways.base import Gateway
from draftgen.gateways.registry import gateway_for

# A read of the page this recent serves a poll that comes after it (at most: the monitor
# asks for half its poll interval where that is shorter).
FRESH_S = 0.25


class GatewayLoads:
    """One gateway's relayed metrics page, read at most once per poll round."""

    def __init__(self, session: aiohttp.ClientSession, gateway: str, *, clock: Clock,
                 timeout_s: float = 5.0, fresh_s: float = FRESH_S,
                 kind: Gateway | None = None) -> None:
        self.gateway = gateway.rstrip("/")
        self.kind = gateway_for() if kind is None else kind
        self.page = self.gateway + self.kind.metrics_path
        self._fresh_s = fresh_s
        self._session = session
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._read: asyncio.Future[None] | None = None
        self.at = float("-inf")  # monotonic time the last read started
        self.readings: dict[str, tuple[Reading, Engine | None]] = {}
        self.failure: str | None = None  # why the last read got no page
        self.reads = 0

    async def read(self) -> None:
        """The page as of this round: joins a read in flight, reuses a fresh one."""
        stale = self._clock.monotonic() - self.at >= self._fresh_s
        if self._read is None or (self._read.done() and stale):
            self._read = asyncio.ensure_future(self._fetch())
        # One poller cancelled (its monitor stopping) must not cancel the others' read.
        await asyncio.shield(self._read)

    async def _fetch(self) -> None:
        self.at = self._clock.monotonic()
        self.reads += 1
        url = self.page
        try:
            async with self._session.get(url, timeout=self._timeout,
                                         headers={"Accept": "text/plain"}) as r:
                status, body = r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.readings, self.failure = {}, f"{url}: {str(e) or type(e).__name__}"
            return
        if status != 200:
            self.readings, self.failure = {}, f"{url}: HTTP {status}"
            return
        self.readings = self.kind.worker_readings(body.decode("utf-8", "replace"))
        self.failure = None


class RelayedPoller:
    """One worker's load as its gateway relays it; `poll()` as `LoadPoller.poll`."""

    refused = False

    def __init__(self, loads: GatewayLoads, url: str, *,
                 log: Callable[[str], None] | None = None) -> None:
        self.url = url.rstrip("/")
        self._loads = loads
        self._log = log
        self._logged: set[tuple[str, ...]] = set()
        self.failure: str | None = None
        self.source: str | None = None

    async def poll(self) -> ServerLoad | None:
        await self._loads.read()
        found = self._loads.readings.get(self.url)
        if self._loads.failure is not None or found is None:
            self.failure = self._loads.failure or (
                f"{self._loads.page} has no series of {self.url}")
            return None
        self.failure = None
        reading, engine = found
        source = (f"{engine.name if engine else 'no known engine'} /metrics via "
                  f"{self._loads.page}")
        if source != self.source:
            self.source = source
            self._say(f"{self.url}: load from {source}")
        load = server_load(self.url, self._loads.at, reading, source)
        if load.missing and load.missing not in self._logged:
            self._logged.add(load.missing)
            self._say(f"{self.url}: load from {source} lacks {', '.join(load.missing)}")
        return load

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log(message)

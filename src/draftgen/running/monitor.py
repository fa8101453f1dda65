"""Watching a run from the side: server loads in, views and records out.

`RunMonitor` polls every up server's load, hands each reading to the scheduler, keeps the
per-server view in the stats, notes outages and gives up when asked to, and leaves three
files for people and tools outside the process:

    events.jsonl      every server and scheduler event with its reason (appended)
    timeseries.jsonl  in flight, tok/s and per-server load every `SERIES_EVERY_S`
    live.json         the latest snapshot of servers and targets (replaced atomically)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson

from draftgen.client.http import Session, open_session
from draftgen.client.load import LoadPoller
from draftgen.clock import Clock
from draftgen.engines.load import ServerLoad
from draftgen.gateways.load import FRESH_S, GatewayLoads, RelayedPoller
from draftgen.running.metrics import MetricsExporter
from draftgen.running.stats import RunStats, ServerSnapshot
from draftgen.schedule.base import Scheduler
from draftgen.schedule.pool import ServerPool, ServerState
from draftgen.store.atomic import write_atomic

EVENTS = "events.jsonl"
SERIES = "timeseries.jsonl"
LIVE = "live.json"
SERIES_EVERY_S = 5.0
# A server whose port refuses the load poll and whose streams have been silent this long
# (or three poll intervals, if longer) is going away.
GONE_SILENT_S = 5.0


class EventLog:
    """Appends events to `events.jsonl`; this task is the file's only writer."""

    def __init__(self, out_dir: Path) -> None:
        self._file: IO[bytes] = open(out_dir / EVENTS, "ab")
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)
        self._file.write(orjson.dumps({"t": time.time(), "msg": message}) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RunMonitor:
    def __init__(self, out_dir: Path, *, pool: ServerPool, scheduler: Scheduler,
                 stats: RunStats, clock: Clock, interval_s: float,
                 give_up_s: float | None, waiting: Callable[[], int],
                 wake: Callable[[], None], give_up: Callable[[str], None],
                 log: Callable[[str], None], metrics: MetricsExporter | None = None,
                 recall: Callable[[list[str]], None] = lambda _ids: None,
                 api_key: str | None = None) -> None:
        self._out = out_dir
        self._api_key = api_key
        self._recall = recall
        self._pool = pool
        self._scheduler = scheduler
        self._stats = stats
        self._clock = clock
        self._interval_s = interval_s
        self._give_up_s = give_up_s
        self._waiting = waiting
        self._wake = wake
        self._give_up = give_up
        self._log = log
        self._metrics = metrics
        self._session: Session | None = None
        self._pollers: dict[str, LoadPoller | RelayedPoller] = {}
        self._gateway_loads: dict[str, GatewayLoads] = {}
        self.loads: dict[str, ServerLoad] = {}
        self._last_series = float("-inf")
        stats.server_view = lambda: tuple(self._server_view())

    async def __aenter__(self) -> RunMonitor:
        self._session = open_session(self._api_key)
        for s in self._pool.servers:
            self._poller(s)
        return self

    def _poller(self, server: ServerState) -> LoadPoller | RelayedPoller:
        """The server's load poller; a server that joined mid-run (a gateway's new worker)
        gets one at its first poll. A worker reached only through its gateway is read from
        the gateway's page, one read per gateway per round."""
        poller = self._pollers.get(server.url)
        if poller is None:
            assert self._session is not None
            route = server.route
            if route is not None and route.relayed:
                loads = self._gateway_loads.get(route.gateway)
                if loads is None:
                    loads = self._gateway_loads[route.gateway] = GatewayLoads(
                        self._session, route.gateway, clock=self._clock,
                        fresh_s=min(FRESH_S, self._interval_s / 2))
                poller = RelayedPoller(loads, server.url, log=self._log)
            else:
                poller = LoadPoller(self._session, server.url, clock=self._clock,
                                    log=self._log)
            self._pollers[server.url] = poller
        return poller

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def poll(self) -> None:
        """Read every up server's load once and pass it on."""
        ups = self._pool.up_servers()
        loads = await asyncio.gather(*(self._poller(s).poll() for s in ups))
        for server, load in zip(ups, loads, strict=True):
            if load is not None:
                self.loads[server.url] = load
                self._scheduler.on_load(server, load)
                if ids := self._scheduler.recall(server):
                    self._recall(ids)
            elif self._pollers[server.url].refused:
                self._check_gone(server)
        if self._metrics is not None:
            self._metrics.update(self._stats.snapshot())
        self._wake()

    def _check_gone(self, server: ServerState) -> None:
        """Nothing listens at the server's port while its streams are silent: it was told
        to stop (SIGTERM closes the listener first, then waits for open streams to end).
        Close them and requeue their samples uncharged, so it can exit now, instead of
        holding them until the hang watchdog.

        A gateway's worker is gone as soon as its own port refuses: the gateway may be
        answering its requests from another worker, so silence cannot be waited for. (One
        reached only through its gateway never refuses here: it leaves when the gateway no
        longer lists it as ready.)"""
        silent_s = self._clock.monotonic() - server.last_progress
        if server.route is not None:
            self._pool.abandon(server, f"its own port refuses ({self._pollers[server.url].failure})"
                                       f"; {server.in_flight} request(s) back to the queue")
        elif server.in_flight and silent_s >= max(GONE_SILENT_S, 3 * self._interval_s):
            self._pool.abandon(server, f"stopped listening ({self._pollers[server.url].failure})"
                                       f" with {server.in_flight} request(s) silent for "
                                       f"{silent_s:.1f}s")

    def _server_view(self) -> list[ServerSnapshot]:
        targets = self._scheduler.targets()
        out = []
        for s in self._pool.servers:
            failure = self._pollers[s.url].failure if s.url in self._pollers else None
            load = None if failure else self.loads.get(s.url)
            out.append(ServerSnapshot(
                s.url, s.up, s.in_flight,
                capacity=load.kv_capacity_tokens if load else None,
                kv_usage=load.kv_usage if load else None,
                running=load.running if load else None,
                waiting=load.waiting if load else None,
                target=targets.get(s.url),
                load_error=failure,
            ))
        return out

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll()
            note = self._pool.note(self._waiting())
            if note or self._stats.note.startswith("server "):
                self._stats.note = note
            down_s = self._pool.all_down_for_s()
            if self._give_up_s is not None and down_s > self._give_up_s:
                self._give_up(f"every server down for {down_s:.0f}s (server_down_give_up_s)")
            if self._clock.monotonic() - self._last_series >= SERIES_EVERY_S:
                self._last_series = self._clock.monotonic()
                self.record()
            await self._clock.sleep(self._interval_s)

    def record(self) -> None:
        """One time-series row and a fresh live.json."""
        snap = self._stats.snapshot()
        servers: dict[str, Any] = {
            s.url: {"up": s.up, "in_flight": s.in_flight, "capacity": s.capacity,
                    "kv_usage": s.kv_usage, "running": s.running, "waiting": s.waiting,
                    "target": s.target}
            for s in snap.servers
        }
        row = {"t": time.time(), "in_flight": snap.in_flight, "tok_s": snap.tok_s_window,
               "servers": servers}
        with open(self._out / SERIES, "ab") as f:
            f.write(orjson.dumps(row) + b"\n")
        write_atomic(self._out / LIVE, orjson.dumps(
            {**row, "eta_s": snap.eta_s, "scheduler": self._scheduler.name,
             "done": snap.total("done"), "pending": snap.total("pending")}))

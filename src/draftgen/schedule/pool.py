"""Which servers may take work: up/down state, liveness probes and the hang watchdog.

A server that stops answering is a state, not an error: dispatch to it stops, a probe
sends a tiny real generation until one succeeds, and then it takes work again. A server
whose in-flight requests all stop streaming for `hang_timeout_s` is treated as hung
(a cheap health check may still answer): its requests are cancelled and re-queued.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from draftgen.clock import Clock


@dataclass(frozen=True, slots=True)
class Route:
    """Where a server's requests go when not to its own URL: a gateway, with the headers
    that address this worker there. `relayed`: the worker's own URL did not answer, so its
    load, settings and liveness are read through the gateway too."""

    gateway: str
    headers: Mapping[str, str] = field(default_factory=dict)
    relayed: bool = False


@dataclass(eq=False, slots=True)
class ServerState:
    url: str  # the server itself: what records name, where its load and settings are read
    # (a relayed route: as its gateway relays them)
    route: Route | None = None
    in_flight: int = 0
    down_since: float | None = None  # wall clock, for people
    down_at: float = 0.0  # monotonic, for give-up
    down_reason: str = ""
    downs: int = 0
    last_progress: float = 0.0  # monotonic: last token, start or end of a request
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def up(self) -> bool:
        return self.down_since is None

    @property
    def send_url(self) -> str:
        return self.route.gateway if self.route else self.url

    @property
    def headers(self) -> Mapping[str, str]:
        return self.route.headers if self.route else {}


Probe = Callable[[ServerState], Awaitable[object]]


class ServerPool:
    def __init__(self, urls: list[str], *, clock: Clock, probe: Probe,
                 routes: Mapping[str, Route] | None = None,
                 hang_timeout_s: float, probe_timeout_s: float = 30.0,
                 probe_interval_s: float = 1.0, probe_interval_max_s: float = 10.0,
                 on_hang: Callable[[ServerState], None] | None = None,
                 on_up: Callable[[ServerState], None] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.servers = [ServerState(u, (routes or {}).get(u)) for u in urls]
        self._clock = clock
        self._probe = probe
        self._hang_timeout_s = hang_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._probe_interval_s = probe_interval_s
        self._probe_interval_max_s = probe_interval_max_s
        self._on_hang = on_hang
        self._on_up = on_up
        self._probes: set[asyncio.Task[None]] = set()
        self._log = log or (lambda _msg: None)

    def up_servers(self) -> list[ServerState]:
        return [s for s in self.servers if s.up]

    def add(self, url: str, route: Route | None = None) -> ServerState:
        """A server (a gateway's new worker) joins mid-run; it takes work from the next pick."""
        server = ServerState(url, route)
        self.servers.append(server)
        self._log(f"{url} joins" + (f" through {route.gateway}" if route else ""))
        return server

    def remove(self, server: ServerState, reason: str) -> None:
        """`server` leaves for good (its gateway no longer lists it): what it holds goes back
        to the queue uncharged, and it is never picked again."""
        if server not in self.servers:
            return
        self._log(f"{server.url} leaves: {reason}")
        if server.in_flight and self._on_hang is not None:
            self._on_hang(server)
        self.servers.remove(server)
        server.down_since = server.down_since or time.time()
        server.down_reason = reason

    def assign(self, server: ServerState) -> None:
        """A request starts on `server`."""
        if server.in_flight == 0:
            # An idle server has had no chance to show progress; its clock starts now.
            server.last_progress = self._clock.monotonic()
        server.in_flight += 1

    def progress(self, server: ServerState) -> None:
        server.last_progress = self._clock.monotonic()

    def mark_down(self, server: ServerState, reason: str) -> None:
        if not server.up:
            return
        server.down_since = time.time()
        server.down_at = self._clock.monotonic()
        server.down_reason = reason
        server.downs += 1
        self._log(f"{server.url} down: {reason}")
        task = asyncio.create_task(self._probe_until_up(server), name=f"probe {server.url}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def mark_up(self, server: ServerState) -> None:
        if server.up:
            return
        took = self._clock.monotonic() - server.down_at
        self._log(f"{server.url} up again after {took:.0f}s")
        server.down_since = None
        server.down_reason = ""
        server.last_progress = self._clock.monotonic()
        if self._on_up is not None:
            self._on_up(server)

    def all_down_for_s(self) -> float:
        """How long every server has been down (0 while any is up)."""
        if self.up_servers():
            return 0.0
        return self._clock.monotonic() - max(s.down_at for s in self.servers)

    async def _probe_until_up(self, server: ServerState) -> None:
        # The first probe goes at once: a reset connection is often a false alarm.
        delay = 0.0
        while not server.up and server in self.servers:
            await self._clock.sleep(delay)
            try:
                async with asyncio.timeout(self._probe_timeout_s):
                    await self._probe(server)
            except Exception:  # any failure means "not yet"; the next probe decides
                delay = min(max(delay * 2, self._probe_interval_s), self._probe_interval_max_s)
                continue
            self.mark_up(server)

    async def watch(self, stop: asyncio.Event, *, interval_s: float = 1.0) -> None:
        """Hang watchdog: no progress on any in-flight request of a server for too long."""
        while not stop.is_set():
            await self._clock.sleep(interval_s)
            now = self._clock.monotonic()
            for s in self.servers:
                if s.up and s.in_flight and now - s.last_progress > self._hang_timeout_s:
                    self.abandon(s, f"no token for {self._hang_timeout_s:.0f}s with "
                                    f"{s.in_flight} requests in flight (hung)")

    def abandon(self, server: ServerState, reason: str) -> None:
        """`server` is down with requests that will not finish: mark it down and hand them
        back (`on_hang`: cancelled, requeued uncharged)."""
        if not server.up:
            return
        self.mark_down(server, reason)
        if self._on_hang is not None:
            self._on_hang(server)

    async def close(self) -> None:
        for t in list(self._probes):
            t.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)

    def note(self, waiting: int) -> str:
        downs = [s for s in self.servers if not s.up]
        return "; ".join(
            f"server {s.url} down since {time.strftime('%H:%M:%S', time.localtime(s.down_since))}"
            f" ({s.down_reason}), {waiting} requests waiting"
            for s in downs if s.down_since is not None
        )

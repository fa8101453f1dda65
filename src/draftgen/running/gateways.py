"""The workers behind the job's gateways: found, verified one by one, addressed through the
gateway by a routing key, and kept fresh while the run goes.

A worker the gateway lists as ready is verified like any server (its own URL: engine,
settings, KV dtype under the quality policy); one the policy refuses is never addressed and
the run says so. Each accepted worker gets a routing key seen to land on it (a 1-token
request per try: on a `--policy manual` gateway the first request with a key pins it to a
worker). Every `WATCH_EVERY_S` the list is read again: a new worker joins the pool, one that
is gone, unhealthy or draining leaves it (what it held goes back to the queue, uncharged).
An answer served by another worker than its key's (a gateway restart forgets its pins; a
retry lands elsewhere) names the worker that served it, and that key is learnt again; an
answer from a worker the run has not accepted is not kept.

A new worker whose own URL does not answer (in a cluster often only the gateway is
reachable) is `relayed`: verified from what the gateway relays of it (its metrics and
labels), its load read from the gateway's page (gateways/load.py), and alive while
the gateway lists it as ready. One that answers is read directly, as any server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from draftgen.client import ChatClient
from draftgen.client.http import Session, answers, get_text
from draftgen.clock import Clock
from draftgen.errors import DraftgenError
from draftgen.gateways.base import Gateway, GatewayError, Worker
from draftgen.gateways.registry import gateway_for
from draftgen.schedule.pool import Route, ServerPool, ServerState

WATCH_EVERY_S = 2.0
# Keys tried to find one that lands on a given worker (random pinning: with W workers each
# try lands on it with probability 1/W).
KEY_TRIES_PER_WORKER = 8
# A worker no key landed on is tried again this long after (a gateway whose keys do not
# stick would otherwise get 8 pings a worker every WATCH_EVERY_S).
KEY_RETRY_S = 60.0

# Verify a worker (gateway, URL, relayed): True when the run may send to it (policy passed
# or unverifiable but allowed), False when the policy refused it (the reason is logged by
# the verifier). `relayed`: its own URL does not answer; read what the gateway relays.
Verify = Callable[[str, str, bool], Awaitable[bool]]


class GatewayWorkers:
    def __init__(self, gateways: list[str], *, client: ChatClient, session: Session,
                 model: str, verify: Verify, clock: Clock,
                 log: Callable[[str], None], kind: Gateway | None = None) -> None:
        self.gateways = gateways
        self.kind = gateway_for() if kind is None else kind
        self._client = client
        self._session = session
        self._model = model
        self._verify = verify
        self._clock = clock
        self._log = log
        self.keys: dict[str, str] = {}  # worker URL -> a routing key pinned to it
        self.accepted: dict[str, str] = {}  # worker URL -> its gateway
        self.refused: set[str] = set()
        self.relayed: set[str] = set()  # workers reached only through their gateway
        self._relearn: set[str] = set()
        self._keyless_until: dict[str, float] = {}  # worker URL -> monotonic time
        self._tag = secrets.token_hex(3)
        self._n = 0

    async def read(self, gateway: str) -> list[Worker] | None:
        """The gateway's workers now; None when it does not answer (it may be restarting)."""
        where = gateway + self.kind.workers_path
        text = await get_text(self._session, where)
        if text is None:
            return None
        try:
            return self.kind.parse_workers(orjson.loads(text), where)
        except orjson.JSONDecodeError:
            raise GatewayError(f"{where}: not JSON") from None

    async def discover(self) -> dict[str, Route]:
        """Every ready, accepted worker of every gateway with its route, before the run."""
        routes: dict[str, Route] = {}
        for gateway in self.gateways:
            workers = await self.read(gateway)
            if workers is None:
                raise GatewayError(f"{gateway}{self.kind.workers_path}: the gateway does not "
                                   "answer")
            await self._sort_out(gateway, workers)
            for w in workers:
                if (route := await self._admit(gateway, w)) is not None:
                    routes[w.url] = route
        return routes

    async def _sort_out(self, gateway: str, workers: list[Worker]) -> None:
        """Which new workers answer on their own URL; asked all at once, since an address
        that cannot be reached may stay silent until the timeout."""
        new = [w.url for w in workers
               if w.ready and w.url not in self.accepted and w.url not in self.refused]
        direct = await asyncio.gather(*(self._answers(url) for url in new))
        for url, ok in zip(new, direct, strict=True):
            if ok:
                self.relayed.discard(url)
            elif url not in self.relayed:
                self.relayed.add(url)
                self._log(f"{gateway}: worker {url} does not answer on its own URL; its "
                          "settings, load and liveness are read through the gateway")

    async def _answers(self, url: str) -> bool:
        return await answers(self._session, url + "/v1/models")

    def reachable(self, urls: list[str]) -> list[str]:
        """`urls` with its gateway in place of each relayed worker (once): where start-up
        can ask whether a server answers."""
        return list(dict.fromkeys(self.accepted[u] if u in self.relayed else u for u in urls))

    async def _admit(self, gateway: str, worker: Worker) -> Route | None:
        if not worker.ready or worker.url in self.refused:
            return None
        if worker.url not in self.accepted:
            if not await self._verify(gateway, worker.url, worker.url in self.relayed):
                self.refused.add(worker.url)
                self._log(f"{gateway}: worker {worker.url} refused by the quality policy; "
                          "no request will be addressed to it")
                return None
            self.accepted[worker.url] = gateway
        if self._clock.monotonic() < self._keyless_until.get(worker.url, float("-inf")):
            return None
        key = await self._key_for(gateway, worker.url)
        if key is None:
            self._keyless_until[worker.url] = self._clock.monotonic() + KEY_RETRY_S
            self._log(f"{gateway}: no routing key landed on {worker.url} in "
                      f"{KEY_TRIES_PER_WORKER * len(self.accepted)} tries (is the gateway "
                      f"started with --policy manual?); not sending to it, trying again in "
                      f"{KEY_RETRY_S:.0f}s")
            return None
        return Route(gateway, {self.kind.routing_header: key}, relayed=worker.url in self.relayed)

    async def _key_for(self, gateway: str, worker: str) -> str | None:
        if worker in self.keys and worker not in self._relearn:
            return self.keys[worker]
        self._relearn.discard(worker)
        for _ in range(KEY_TRIES_PER_WORKER * max(1, len(self.accepted))):
            self._n += 1
            key = f"draftgen-{self._tag}-{self._n}"
            body: dict[str, Any] = {"model": self._model, "max_tokens": 1,
                                    "messages": [{"role": "user", "content": "ping"}]}
            done = await self._client.chat(gateway, body, headers={self.kind.routing_header: key})
            served = done.served_by
            if served is None:
                return None  # not a gateway that names its workers
            if self.accepted.get(served) == gateway and (
                    served not in self.keys or served == worker):
                self.keys[served] = key
            if served == worker:
                return key
        return None

    def served(self, server: ServerState, served_by: str | None) -> bool:
        """Whether an answer `server`'s request got may be kept: it was served by a worker
        the run accepted. A different worker than the key's means the pin moved: learn it
        again."""
        if server.route is None or served_by is None or served_by == server.url:
            return True
        self._relearn.add(server.url)
        if served_by not in self.accepted:
            self._log(f"{server.route.gateway}: an answer for {server.url} came from "
                      f"{served_by}, which this run has not accepted; not kept")
            return False
        return True

    async def reach(self, server: ServerState) -> None:
        """Learn a routing key that lands on `server` now (its gateway may have restarted
        and forgotten every pin, or the worker come back): a GatewayError if none does.
        Only a worker that is up is tried: its own port answers, or (relayed) its gateway
        lists it as ready."""
        route = server.route
        assert route is not None
        gateway = route.gateway
        if route.relayed:
            listed = await self.read(gateway)
            if not any(w.url == server.url and w.ready for w in listed or ()):
                raise GatewayError(f"{gateway} does not list {server.url} as ready")
        elif await get_text(self._session, server.url + "/health") is None:
            raise GatewayError(f"{server.url} does not answer on its own port")
        self._relearn.add(server.url)
        key = await self._key_for(gateway, server.url)
        if key is None:
            raise GatewayError(f"{gateway}: no routing key lands on {server.url}")
        server.route = dataclasses.replace(route, headers={self.kind.routing_header: key})

    async def watch(self, pool: ServerPool, stop: asyncio.Event) -> None:
        """Keep `pool` to what the gateways list, every WATCH_EVERY_S, until `stop`."""
        while not stop.is_set():
            await self._clock.sleep(WATCH_EVERY_S)
            for gateway in self.gateways:
                try:
                    await self._refresh(pool, gateway)
                except DraftgenError as e:  # keep what we have, say why; try again next time
                    self._log(f"{gateway}: worker list not read: {e}")

    async def _refresh(self, pool: ServerPool, gateway: str) -> None:
        workers = await self.read(gateway)
        if workers is None:
            return  # down or restarting: its workers' requests tell the pool
        listed = {w.url: w for w in workers}
        mine = {s.url: s for s in pool.servers
                if s.route is not None and s.route.gateway == gateway}
        for url, server in mine.items():
            w = listed.get(url)
            if w is None or not w.ready:
                why = "no longer listed" if w is None else f"status {w.status or 'unhealthy'}"
                pool.remove(server, f"{gateway}: {why}")
                self.keys.pop(url, None)
            elif url in self._relearn and server.up:
                await self.reach(server)
        await self._sort_out(gateway, [w for w in workers if w.url not in mine])
        for w in workers:
            if w.url not in mine and (route := await self._admit(gateway, w)) is not None:
                pool.add(w.url, route)

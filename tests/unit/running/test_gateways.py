"""The workers behind a gateway: found, verified, addressed by a key that lands on them,
kept fresh; an answer from a worker the run did not accept is not kept.

The gateway here is scripted in-process: its worker list is a variable, and a routing key
pins to a worker on first use, in turn, as smg's manual policy does (at random there).
The real gateway runs in tests/integration/test_gateway.py.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from draftgen.clock import FakeClock
from draftgen.gateways.base import GatewayError, Worker
from draftgen.gateways.smg.api import ROUTING_KEY_HEADER
from draftgen.running import gateways
from draftgen.running.gateways import GatewayWorkers
from draftgen.sample import Turn
from draftgen.schedule.pool import Route, ServerPool, ServerState

GW = "http://gw:1"
A, B, C = "http://a:1", "http://b:1", "http://c:1"


class ScriptedGateway:
    """`chat` answers as a manual-policy gateway: a key pins to the next listed worker."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers
        self.pins: dict[str, str] = {}
        self._turn = itertools.count()
        self.sent = 0

    async def chat(self, url: str, body: dict[str, Any], *, headers: dict[str, str],
                   **_: Any) -> Turn:
        assert url == GW
        self.sent += 1
        key = headers[ROUTING_KEY_HEADER]
        if self.pins.get(key) not in self.workers:
            self.pins[key] = self.workers[next(self._turn) % len(self.workers)]
        return Turn("x", None, "length", 1, 1, 0.0, 0.0, served_by=self.pins[key])


def gateway_workers(gw: ScriptedGateway, refuse: set[str] = frozenset(),  # type: ignore[assignment]
                    log: list[str] | None = None,
                    unreachable: set[str] = frozenset(),  # type: ignore[assignment]
                    verified: list[tuple[str, bool]] | None = None) -> GatewayWorkers:
    """`unreachable`: workers whose own URL does not answer (only the gateway does);
    `verified` collects each verification asked, with whether it was to be relayed."""
    async def verify(_gateway: str, url: str, relayed: bool) -> bool:
        if verified is not None:
            verified.append((url, relayed))
        return url not in refuse

    g = GatewayWorkers([GW], client=gw, session=None, model="m",  # type: ignore[arg-type]
                       verify=verify, clock=FakeClock(),
                       log=(log if log is not None else []).append)

    async def read(_gateway: str) -> list[Worker]:
        return [Worker(u, u, True, "ready") for u in gw.workers]

    async def answers(url: str) -> bool:
        return url not in unreachable

    g.read = read  # type: ignore[method-assign]
    g._answers = answers  # type: ignore[method-assign]
    return g


def test_each_accepted_worker_gets_a_key_that_lands_on_it_and_a_refused_one_none() -> None:
    gw = ScriptedGateway([A, B, C])
    log: list[str] = []
    g = gateway_workers(gw, refuse={B}, log=log)
    routes = asyncio.run(g.discover())
    assert set(routes) == {A, C}
    for url, route in routes.items():
        assert route.gateway == GW
        assert gw.pins[route.headers[ROUTING_KEY_HEADER]] == url
    assert any(B in m and "refused by the quality policy" in m for m in log)
    assert not any(pinned == B for key, pinned in gw.pins.items()
                   if key in {r.headers[ROUTING_KEY_HEADER] for r in routes.values()})


def test_an_answer_from_a_worker_not_accepted_is_not_kept_and_the_key_is_learnt_again() -> None:
    gw = ScriptedGateway([A, B])
    g = gateway_workers(gw, refuse={B})
    routes = asyncio.run(g.discover())
    server = ServerState(A, routes[A])
    assert g.served(server, A) is True
    assert g.served(server, B) is False  # refused: its answer would be lossy
    assert g.served(server, "http://new:1") is False  # not verified yet
    assert A in g._relearn
    assert g.served(ServerState("http://direct:1"), None) is True


def test_a_gateway_that_names_no_worker_gives_no_route() -> None:
    gw = ScriptedGateway([A])

    async def anonymous(url: str, body: dict[str, Any], **kw: Any) -> Turn:
        gw.sent += 1
        return Turn("x", None, "length", 1, 1, 0.0, 0.0)

    gw.chat = anonymous  # type: ignore[method-assign]
    log: list[str] = []
    g = gateway_workers(gw, log=log)
    routes = asyncio.run(g.discover())
    assert routes == {}
    assert any("no routing key landed" in m for m in log)
    # Not tried again at every read of the list: only after KEY_RETRY_S.
    sent = gw.sent
    assert asyncio.run(g._admit(GW, Worker(A, A, True, "ready"))) is None
    assert gw.sent == sent
    g._clock.advance(gateways.KEY_RETRY_S)  # type: ignore[attr-defined]
    asyncio.run(g._admit(GW, Worker(A, A, True, "ready")))
    assert gw.sent > sent


def test_the_pool_follows_the_list_a_worker_added_joins_one_gone_leaves() -> None:
    gw = ScriptedGateway([A, B])
    g = gateway_workers(gw)
    requeued: list[str] = []

    async def go() -> ServerPool:
        routes = await g.discover()

        async def probe(_s: ServerState) -> None:
            return None

        pool = ServerPool(list(routes), routes=routes, clock=FakeClock(), probe=probe,
                          hang_timeout_s=60, on_hang=lambda s: requeued.append(s.url))
        pool.servers[0].in_flight = 3  # A holds three requests
        gw.workers = [B, C]  # A removed at the gateway, C added
        await g._refresh(pool, GW)
        return pool

    pool = asyncio.run(go())
    assert [s.url for s in pool.servers] == [B, C]
    assert requeued == [A]  # what A held goes back to the queue
    c = pool.servers[1]
    assert c.route is not None and gw.pins[c.route.headers[ROUTING_KEY_HEADER]] == C


def test_a_worker_back_after_an_outage_is_reached_by_a_new_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gw = ScriptedGateway([A, B])
    g = gateway_workers(gw)

    async def alive(_session: Any, _url: str, **_: Any) -> str:
        return "ok"

    monkeypatch.setattr(gateways, "get_text", alive)

    async def go() -> Route | None:
        routes = await g.discover()
        server = ServerState(A, routes[A])
        gw.pins.clear()  # a restarted gateway forgets every pin
        gw.workers = [B, A]  # and pins the next new key elsewhere first
        await g.reach(server)
        return server.route

    route = asyncio.run(go())
    assert route is not None
    assert gw.pins[route.headers[ROUTING_KEY_HEADER]] == A


def test_a_worker_whose_own_port_is_silent_is_not_reached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gw = ScriptedGateway([A])
    g = gateway_workers(gw)

    async def dead(_session: Any, _url: str, **_: Any) -> None:
        return None

    async def go() -> None:
        routes = await g.discover()
        monkeypatch.setattr(gateways, "get_text", dead)
        await g.reach(ServerState(A, routes[A]))

    with pytest.raises(GatewayError, match="does not answer on its own port"):
        asyncio.run(go())


def test_a_worker_only_the_gateway_reaches_is_verified_and_routed_as_relayed() -> None:
    gw = ScriptedGateway([A, B])
    log: list[str] = []
    verified: list[tuple[str, bool]] = []
    g = gateway_workers(gw, unreachable={B}, log=log, verified=verified)
    routes = asyncio.run(g.discover())
    assert set(routes) == {A, B}
    assert not routes[A].relayed and routes[B].relayed  # A answers itself: read directly
    assert sorted(verified) == [(A, False), (B, True)]
    assert gw.pins[routes[B].headers[ROUTING_KEY_HEADER]] == B
    assert [m for m in log if "does not answer on its own URL" in m] == [
        f"{GW}: worker {B} does not answer on its own URL; its settings, load and "
        "liveness are read through the gateway"]
    # Start-up asks the gateway in place of the worker it cannot reach.
    assert g.reachable([A, B, "http://direct:1"]) == [A, GW, "http://direct:1"]


def test_a_relayed_worker_joining_mid_run_is_relayed_too() -> None:
    gw = ScriptedGateway([A])
    g = gateway_workers(gw, unreachable={C})

    async def go() -> ServerPool:
        routes = await g.discover()

        async def probe(_s: ServerState) -> None:
            return None

        pool = ServerPool(list(routes), routes=routes, clock=FakeClock(), probe=probe,
                          hang_timeout_s=60, on_hang=lambda _s: None)
        gw.workers = [A, C]
        await g._refresh(pool, GW)
        return pool

    pool = asyncio.run(go())
    route = pool.servers[1].route
    assert pool.servers[1].url == C and route is not None and route.relayed


def test_a_relayed_worker_is_up_while_the_gateway_lists_it_not_while_its_port_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gw = ScriptedGateway([A, B])
    g = gateway_workers(gw, unreachable={B})
    own_port: list[str] = []

    async def silent(_session: Any, url: str, **_: Any) -> None:
        own_port.append(url)
        return None

    monkeypatch.setattr(gateways, "get_text", silent)

    async def go() -> ServerState:
        routes = await g.discover()
        server = ServerState(B, routes[B])
        gw.pins.clear()  # a restarted gateway forgets every pin
        await g.reach(server)
        return server

    server = asyncio.run(go())
    assert own_port == []  # its own port was never asked
    assert server.route is not None and server.route.relayed
    assert gw.pins[server.route.headers[ROUTING_KEY_HEADER]] == B

    async def unlisted(_gateway: str) -> list[Worker]:
        return [Worker(A, A, True, "ready"), Worker(B, B, False, "ready")]  # B unhealthy

    g.read = unlisted  # type: ignore[method-assign]
    with pytest.raises(GatewayError, match="does not list http://b:1 as ready"):
        asyncio.run(g.reach(server))

"""The gateways by name, and what a URL given as a gateway (`servers: [{gateway: URL}]`,
`run --gateway`) is read as.

A new gateway is one folder beside `smg/` implementing `base.Gateway`, and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping

from draftgen.gateways.base import Gateway, GatewayError
from draftgen.gateways.smg.gateway import Smg

GATEWAYS: dict[str, Gateway] = {g.name: g for g in (Smg(),)}


def gateway_for(name: str | None = None) -> Gateway:
    """The gateway called `name`; with none, the one a gateway URL is read as (the first)."""
    if name is None:
        return next(iter(GATEWAYS.values()))
    try:
        return GATEWAYS[name]
    except KeyError:
        raise GatewayError(f"unknown gateway {name!r}; known: {sorted(GATEWAYS)}") from None


def served_by(headers: Mapping[str, str]) -> str | None:
    """The worker an answer's headers say served it, whichever gateway relayed it; None for
    an answer that came straight from a server."""
    for gateway in GATEWAYS.values():
        if found := headers.get(gateway.served_header):
            return found
    return None

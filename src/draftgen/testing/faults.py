"""Which chat requests the fault proxy breaks, and how: the fault kinds, a mix of them, and
the seeded per-request decisions (`faultproxy.py` carries them out on the wire)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

STATUS_FAULTS: Mapping[str, int] = MappingProxyType(
    {"status_500": 500, "status_503": 503, "status_429": 429}
)
MID_STREAM_FAULTS = frozenset({"reset_mid_stream", "stall_mid_stream", "cut_stream"})
# The order decisions are drawn in; fixed so a seed means the same thing whatever order a
# caller's weights mapping has.
FAULT_KINDS = (*STATUS_FAULTS, "reset_before", "reset_mid_stream", "stall_mid_stream", "cut_stream")
MAX_EVENTS_BEFORE_FAULT = 20

def all_kinds_equally() -> Mapping[str, float]:
    return MappingProxyType(dict.fromkeys(FAULT_KINDS, 1.0))


@dataclass(frozen=True)
class FaultMix:
    """How often requests get a fault, and which kinds, relative to each other."""

    rate: float = 0.10
    weights: Mapping[str, float] = field(default_factory=all_kinds_equally, hash=False)
    # Should exceed the client's idle timeout, so the stall is seen as one.
    stall_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {self.rate}")
        unknown = sorted(set(self.weights) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; known: {', '.join(FAULT_KINDS)}")
        if any(not w >= 0 for w in self.weights.values()):
            raise ValueError(f"fault weights must be >= 0, got {dict(self.weights)}")
        if self.rate > 0 and not any(w > 0 for w in self.weights.values()):
            raise ValueError("rate > 0 needs at least one fault kind with a weight > 0")
        if not self.stall_s >= 0:
            raise ValueError(f"stall_s must be >= 0, got {self.stall_s}")
        # A private copy: the caller's dict changing later must not change a frozen mix.
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))


@dataclass(frozen=True, slots=True)
class Decision:
    kind: str | None  # None: forward clean
    after_events: int  # for mid-stream kinds: SSE events sent before the fault


class FaultPicker:
    """The per-request decisions of one seed, in order.

    Each call draws exactly three numbers whatever it decides, so whether request k gets a
    fault depends on the seed and `rate` only, not on the weights.
    """

    def __init__(self, mix: FaultMix, seed: int) -> None:
        self._rate = mix.rate
        self._rng = random.Random(seed)
        kinds = [k for k in FAULT_KINDS if mix.weights.get(k, 0) > 0]
        total = sum(mix.weights[k] for k in kinds)
        bounds: list[tuple[float, str]] = []
        acc = 0.0
        for kind in kinds:
            acc += mix.weights[kind] / total
            bounds.append((acc, kind))
        self._bounds = bounds

    def next(self) -> Decision:
        rng = self._rng
        hit, pick, events = rng.random(), rng.random(), rng.random()
        after_events = 1 + int(events * MAX_EVENTS_BEFORE_FAULT)
        if hit >= self._rate or not self._bounds:
            return Decision(None, after_events)
        # Float sums can leave the last bound a hair under 1.0; the last kind takes the rest.
        kind = next((k for bound, k in self._bounds if pick < bound), self._bounds[-1][1])
        return Decision(kind, after_events)


def parse_weights(spec: str | None) -> Mapping[str, float]:
    """`"cut_stream,status_503=2"` → {"cut_stream": 1.0, "status_503": 2.0}."""
    if not spec:
        return all_kinds_equally()
    weights: dict[str, float] = {}
    for item in spec.split(","):
        name, _, weight = item.strip().partition("=")
        weights[name] = float(weight) if weight else 1.0
    return weights

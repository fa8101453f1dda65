"""Who may send what, when: the contract between the runner and a scheduling policy.

The runner keeps one queue of pending samples per partition and asks the scheduler, each
time something changes, which partition's next sample to send and to which server. The base
class keeps the books every policy needs (what is in flight where, expected output lengths
learned from finished samples); a policy writes `pick` and, if it adapts, `on_load` and `recall`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from draftgen.engines.load import ServerLoad
from draftgen.sample import Sample
from draftgen.schedule.lengths import Lengths
from draftgen.schedule.pool import ServerState


@dataclass(slots=True)
class PartitionView:
    """What a scheduler may know about one partition's queue."""

    name: str
    concurrency: int
    max_tokens: int
    queued: int
    head: Sample | None
    in_flight: int = 0


@dataclass(slots=True, eq=False)
class Flight:
    """One request in flight: where it went, and how many tokens it has written so far
    (the runner counts them as they stream in)."""

    sample: Sample
    url: str
    written: int = 0  # tokens of the answer being written
    earlier: int = 0  # tokens of earlier turns' answers (multi-turn), now part of the prompt

    def next_turn(self) -> None:
        self.earlier += self.written
        self.written = 0


@dataclass(slots=True)
class Books:
    """What is in flight where, and the output lengths learned so far."""

    flights: dict[str, Flight] = field(default_factory=dict)  # sample id → flight
    lengths: Lengths = field(default_factory=Lengths)


class Scheduler:
    """Bookkeeping shared by every policy; subclasses decide in `pick`."""

    name = "base"

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.books = Books()
        self.set_log(log)

    def set_log(self, log: Callable[[str], None] | None) -> None:
        """Where the policy says what it decided (a run's event log); None: nowhere."""
        self._log = log or (lambda _msg: None)

    def learn_prior(self, category: str, done: int, output_tokens: int) -> None:
        """Output lengths recorded by earlier runs seed the expectation."""
        self.books.lengths.learn_prior(category, done, output_tokens)

    def state(self) -> dict[str, float]:
        """What this policy learned of each server that a later run should start from."""
        return {}

    def restore(self, state: Mapping[str, float]) -> None:
        """Start from what an earlier run of this directory learned (`state()`)."""

    def started(self, sample: Sample, server: ServerState) -> Flight:
        """`sample` was sent to `server`; the runner adds streamed tokens to the flight."""
        flight = Flight(sample, server.url)
        self.books.flights[sample.id] = flight
        return flight

    def ended(self, sample: Sample, server: ServerState, output_tokens: int | None) -> None:
        """A request left the server; `output_tokens` is None when it did not finish."""
        self.books.flights.pop(sample.id, None)
        if output_tokens is not None:
            self.books.lengths.add(sample.category, output_tokens)

    def on_load(self, server: ServerState, load: ServerLoad) -> None:
        """A fresh load reading for `server`; static policies ignore it."""

    def limit_known(self, url: str, limit: int, source: str) -> None:
        """`url` runs at most `limit` requests at once, as `source` says (a server draftgen
        launched knows its own); static policies ignore it."""

    def recall(self, server: ServerState) -> list[str]:
        """Sample ids of requests on `server` to call back and queue again (none here)."""
        return []

    def pick(self, partitions: Sequence[PartitionView],
             servers: Sequence[ServerState]) -> tuple[str, ServerState] | None:
        """The partition whose head sample to send, and where; None to wait."""
        raise NotImplementedError

    def targets(self) -> Mapping[str, float]:
        """The current admission target per server (KV tokens), for people and metrics."""
        return {}

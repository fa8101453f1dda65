"""Who may send what, when: the contract between the runner and a scheduling policy.

The runner keeps one queue of pending samples per partition and asks the scheduler, each
time something changes, which partition's next sample to send and to which server. The base
class keeps the books every policy needs (what is in flight where, expected output lengths
learned from finished samples); a policy writes `pick` and, if it adapts, `on_load`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from draftgen.sample import Sample
from draftgen.schedule.load import ServerLoad
from draftgen.serverpool import ServerState


@dataclass(slots=True)
class PartitionView:
    """What a scheduler may know about one partition's queue."""

    name: str
    concurrency: int
    max_tokens: int
    queued: int
    head: Sample | None
    in_flight: int = 0


@dataclass(slots=True)
class _Mean:
    n: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x

    @property
    def value(self) -> float | None:
        return self.total / self.n if self.n else None


@dataclass(slots=True)
class Books:
    """Expected KV tokens in flight per server, and learned output lengths."""

    in_flight_tokens: dict[str, float] = field(default_factory=dict)
    output_means: dict[str, _Mean] = field(default_factory=dict)
    overall: _Mean = field(default_factory=_Mean)
    footprints: dict[str, float] = field(default_factory=dict)  # sample id → admitted size


class Scheduler:
    """Bookkeeping shared by every policy; subclasses decide in `pick`."""

    name = "base"

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.books = Books()
        self._log = log or (lambda _msg: None)

    def learn_prior(self, category: str, done: int, output_tokens: int) -> None:
        """Output lengths recorded by earlier runs seed the expectation."""
        if done:
            m = self.books.output_means.setdefault(category, _Mean())
            m.n += done
            m.total += output_tokens
            self.books.overall.n += done
            self.books.overall.total += output_tokens

    def expected_output(self, sample: Sample) -> float:
        m = self.books.output_means.get(sample.category)
        mean = m.value if m is not None else None
        if mean is None:
            mean = self.books.overall.value
        if mean is None:
            mean = sample.max_tokens / 2  # a prior until the first samples finish
        return min(mean, float(sample.max_tokens))

    def footprint(self, sample: Sample) -> float:
        """KV tokens a request holds at its end: its prompt plus its expected answer."""
        return sample.prompt_tokens + self.expected_output(sample)

    def started(self, sample: Sample, server: ServerState) -> None:
        size = self.footprint(sample)
        self.books.footprints[sample.id] = size
        self.books.in_flight_tokens[server.url] = (
            self.books.in_flight_tokens.get(server.url, 0.0) + size)

    def ended(self, sample: Sample, server: ServerState, output_tokens: int | None) -> None:
        """A request left the server; `output_tokens` is None when it did not finish."""
        size = self.books.footprints.pop(sample.id, 0.0)
        self.books.in_flight_tokens[server.url] = max(
            0.0, self.books.in_flight_tokens.get(server.url, 0.0) - size)
        if output_tokens is not None:
            self.books.output_means.setdefault(sample.category, _Mean()).add(output_tokens)
            self.books.overall.add(output_tokens)

    def on_load(self, server: ServerState, load: ServerLoad) -> None:
        """A fresh load reading for `server`; static policies ignore it."""

    def pick(self, partitions: Sequence[PartitionView],
             servers: Sequence[ServerState]) -> tuple[str, ServerState] | None:
        """The partition whose head sample to send, and where; None to wait."""
        raise NotImplementedError

    def targets(self) -> Mapping[str, float]:
        """The current admission target per server (KV tokens), for people and metrics."""
        return {}

"""How long a run has left, when answers end on their own.

Remaining tokens at the finished answers' mean over the present rate says too little on
both ends of a run. At its start the first answers to finish are the shortest: a mean of
those alone promises an early end. At its end the last answers run at a few streams each,
not at the run's full rate. So, as the adaptive scheduler paces partitions
(`schedule/adaptive.py`, `_finish`), each partition is counted in steps of its own streams:
its queued answers at their expected length and its running ones at what they are expected
to write still — both from the survival curve, with the answers still running counted as
censored (`Lengths.expected_left`) — shared over the answers it runs at once; once its
queue is empty, its longest expected answer. The run ends with its slowest partition. A
step takes what the engine's rate of the last `RATE_WINDOW_S` seconds, shared by the answers
it is writing now, gives each: on an engine that is busy (compute-bound on a CPU, and near
it on a GPU at high batch), the answers left get the room the finished ones leave.

Replayed over a recorded run of the demo on the real model (tests/unit/running/test_eta.py,
`bench/eta.py`): within 28% of the time really left from a tenth of the run on, but for its
last seconds; the ETA before it was 30-90% short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from draftgen.schedule.lengths import Lengths

RATE_WINDOW_S = 10  # the engine's rate over this many seconds paces a step


@dataclass(frozen=True, slots=True)
class Stream:
    """One request in flight."""

    category: str
    written: int  # tokens it has written, all turns
    answer: int  # of them, its present answer's (0: it has not begun to answer)


@dataclass(frozen=True, slots=True)
class PartitionWork:
    """One partition's work left."""

    max_tokens: int
    queued: Mapping[str, int]  # category -> samples not yet sent
    flights: Sequence[Stream]


def time_left(parts: Sequence[PartitionWork], lengths: Lengths, rate: float) -> float | None:
    """Seconds until the last answer ends, at `rate` tokens a second (the engine's, over the
    last RATE_WINDOW_S); None while no answer is being written to pace a step by."""
    if not any(p.queued or p.flights for p in parts):
        return 0.0
    writing = sum(1 for p in parts for f in p.flights if f.answer)
    if rate <= 0 or not writing:
        return None
    return max(_steps(p, lengths) for p in parts) * writing / rate


def _steps(p: PartitionWork, lengths: Lengths) -> float:
    """Tokens each of the partition's streams writes until its last answer ends."""
    running = [lengths.expected_left(f.category, p.max_tokens, f.written) for f in p.flights]
    if not p.queued:
        return max(running, default=0.0)
    queued = sum(n * lengths.expected_left(c, p.max_tokens) for c, n in p.queued.items())
    return (queued + sum(running)) / max(len(p.flights), 1)

"""Scheduling policies on plain data: no server, no clock needed."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque

import pytest

from draftgen.engines.load import ServerLoad
from draftgen.sample import Sample
from draftgen.schedule import adaptive, lengths
from draftgen.schedule.adaptive import AdaptiveScheduler
from draftgen.schedule.base import PartitionView, Scheduler
from draftgen.schedule.lengths import Lengths
from draftgen.schedule.pool import ServerState
from draftgen.schedule.static import StaticScheduler


def sample(i: int, part: str = "short", prompt: int = 100, max_tokens: int = 400,
           cat: str = "c") -> Sample:
    return Sample(id=f"{part}-{i}", category=cat, partition=part, messages=(),
                  max_tokens=max_tokens, prompt_tokens=prompt)


# Readings 0.5 s apart, as the load poller takes them in the benchmarks.
_READ_AT = itertools.count(0.0, 0.5)


def load(url: str, *, capacity: int | None = 1000, waiting: int = 0, preempt: int = 0,
         usage: float | None = 0.5, running: int = 1, at: float | None = None) -> ServerLoad:
    when = next(_READ_AT) if at is None else at
    return ServerLoad(url=url, at=when, kv_capacity_tokens=capacity, kv_used_tokens=None,
                      kv_usage=usage, running=running, waiting=waiting,
                      preemptions_total=preempt, generation_tokens_total=None,
                      engine_steps_total=None, source="test", missing=())


def learn(sched: Scheduler, output_tokens: list[int], cat: str = "c") -> None:
    """Finished answers of these lengths, as if earlier requests had ended."""
    server = ServerState("elsewhere")
    for i, n in enumerate(output_tokens):
        sched.ended(sample(10_000 + i, cat=cat), server, n)


class Queues:
    """A minimal stand-in for the runner's queues, driving a scheduler to a fixed point."""

    def __init__(self, sched: Scheduler, parts: dict[str, tuple[int, list[Sample]]]) -> None:
        self.sched = sched
        self.conc = {k: v[0] for k, v in parts.items()}
        self.q = {k: deque(v[1]) for k, v in parts.items()}
        self.flight: dict[str, list[tuple[Sample, ServerState]]] = {k: [] for k in parts}

    def views(self) -> list[PartitionView]:
        return [PartitionView(k, self.conc[k], q[0].max_tokens if q else 400, len(q),
                              q[0] if q else None, len(self.flight[k]))
                for k, q in self.q.items()]

    def fill(self, servers: list[ServerState], *,
             answer: bool = True) -> list[tuple[str, str]]:
        """Send until the scheduler waits; with `answer`, each request begins to answer
        (its first token) before the next is picked."""
        admitted = []
        while (picked := self.sched.pick(self.views(), servers)) is not None:
            name, server = picked
            s = self.q[name].popleft()
            server.in_flight += 1
            flight = self.sched.started(s, server)
            if answer:
                flight.written = 1
            self.flight[name].append((s, server))
            admitted.append((name, server.url))
        return admitted

    def finish(self, name: str, output_tokens: int) -> None:
        s, server = self.flight[name].pop(0)
        server.in_flight -= 1
        self.sched.ended(s, server, output_tokens)


# --- static -------------------------------------------------------------------------

def test_static_respects_each_partitions_concurrency_and_round_robins() -> None:
    q = Queues(StaticScheduler(), {"short": (3, [sample(i) for i in range(10)]),
                                   "long": (1, [sample(i, "long") for i in range(5)])})
    a, b = ServerState("a"), ServerState("b")
    admitted = q.fill([a, b])
    assert [n for n, _ in admitted].count("short") == 3
    assert [n for n, _ in admitted].count("long") == 1
    assert admitted[:2] == [("short", "a"), ("long", "b")]  # alternating, least busy server
    assert (a.in_flight, b.in_flight) == (2, 2)
    b.down_since = 1.0
    q.finish("short", 10)
    assert q.fill([a, b]) == [("short", "a")]
    a.down_since = 1.0
    q.finish("short", 10)
    assert q.fill([a, b]) == []


# --- output lengths -----------------------------------------------------------------

def test_lengths_survival_follows_the_answers_seen() -> None:
    ls = Lengths()
    for n in range(1, 101):
        ls.add("c", n)
    assert ls.mean("c", 1000) == pytest.approx(50.5)
    assert ls.mean("c", 40) == 40.0  # never more than max_tokens
    # Of the answers longer than 50, half are longer than 75; none reach max_tokens 90.
    assert ls.still_running("c", 1000, 50, [0, 25, 50]) == pytest.approx([1.0, 0.5, 0.0])
    assert ls.still_running("c", 90, 50, [25, 40]) == pytest.approx([0.5, 0.0])
    # Longer than every answer seen: expected to run on to max_tokens.
    assert ls.still_running("c", 1000, 150, [0, 849, 850]) == [1.0, 1.0, 0.0]


def test_lengths_count_the_answers_still_running_as_longer_than_written_so_far() -> None:
    ls = Lengths()
    for n in range(1, 17):  # the first answers to finish are the short ones
        ls.add("c", n)
    assert ls.still_running("c", 1000, 0, [16]) == [0.0]  # finished ones alone: all short
    # 16 more are still running, each past 100 tokens: half the answers run past 16.
    ls.running({"c": [100] * 16})
    assert ls.still_running("c", 1000, 0, [8, 16, 200]) == pytest.approx([0.75, 0.5, 0.5])
    # Past every finished length the running ones say nothing ends: on to max_tokens.
    assert ls.still_running("c", 1000, 50, [0, 949, 950]) == [1.0, 1.0, 0.0]
    # The fallback to every category's answers counts every category's running ones.
    assert ls.still_running("other", 1000, 0, [16]) == pytest.approx([0.5])
    ls.running({})
    assert ls.still_running("c", 1000, 0, [8, 16]) == pytest.approx([0.5, 0.0])


def test_lengths_fall_back_from_category_to_all_to_prior_to_max_tokens() -> None:
    ls = Lengths()
    assert ls.mean("new", 400) == 200.0  # nothing known: half of max_tokens for planning
    # ...but for the projection a request is assumed to run to max_tokens.
    assert ls.still_running("new", 400, 0, [0, 399, 400]) == [1.0, 1.0, 0.0]
    ls.learn_prior("new", 10, 1000)  # earlier runs: 100 tokens on average
    assert ls.mean("new", 400) == 100.0
    assert ls.still_running("new", 400, 0, [0, 99, 100]) == [1.0, 1.0, 0.0]
    assert ls.still_running("new", 400, 150, [0, 249, 250]) == [1.0, 1.0, 0.0]  # past it
    for _ in range(lengths.MIN_SAMPLES):
        ls.add("other", 30)
    assert ls.mean("new", 400) == 30.0  # every category's answers beat a prior
    for _ in range(lengths.MIN_SAMPLES):
        ls.add("new", 60)
    assert ls.mean("new", 400) == 60.0  # and its own beat everyone's


def test_lengths_keep_only_recent_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lengths, "KEEP", 20)
    ls = Lengths()
    for n in [10] * 20 + [100] * 20:
        ls.add("c", n)
    assert ls.mean("c", 1000) == 100.0
    assert ls.still_running("c", 1000, 0, [99, 100]) == [1.0, 0.0]


# --- adaptive admission ---------------------------------------------------------------

def test_adaptive_admits_while_the_projected_kv_use_fits_the_capacity() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=1000))
    q = Queues(sched, {"short": (150, [sample(i) for i in range(40)])})
    # Nothing learned yet: each request may run to max_tokens, holding up to
    # 100 + 375 tokens at the last look-ahead point before 400; two fit in 1,000.
    assert len(q.fill([server])) == 2
    q.finish("short", 50)
    q.finish("short", 50)
    learn(sched, [50] * (lengths.MIN_SAMPLES - 2))
    # Every answer ends at 50 tokens: a request holds at most 100 + 25 at the points
    # before it ends, so eight fit at once.
    assert len(q.fill([server])) == 8
    assert sched.targets() == {"a": 1000.0}


def test_a_request_that_has_written_more_is_expected_to_hold_more() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=1000))
    learn(sched, [20] * 8 + [400] * 8)  # half the answers end at once, half run long
    q = Queues(sched, {"short": (150, [sample(i, prompt=10) for i in range(40)])})
    # Fresh, a request is still running at 375 tokens with chance 1/2: 385 / 2 tokens.
    assert len(q.fill([server])) == 5
    # Past 20 tokens, every one is a long answer: each now expects to hold 390.
    for f in sched.books.flights.values():
        f.written = 30
    sched.on_load(server, load("a", capacity=1000))
    assert max(sched._projection("a")) == pytest.approx(5 * 390)
    assert q.fill([server]) == []


def test_running_answers_keep_the_first_short_ones_from_inflating_admission(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def admitted() -> int:
        sched = AdaptiveScheduler()
        server = ServerState("a")
        sched.on_load(server, load("a", capacity=4000))
        q = Queues(sched, {"short": (150, [sample(i, prompt=10) for i in range(60)])})
        first = len(q.fill([server]))
        for f in sched.books.flights.values():
            f.written = 100  # all still running, past 100 tokens
        learn(sched, list(range(1, lengths.MIN_SAMPLES + 1)))  # others ended within 16
        return first + len(q.fill([server]))

    # Ten go out under the prior (each may run to max_tokens). Learned from the 16 short
    # answers alone, a fresh request looks done within 16 tokens and the whole queue
    # would follow; with the ten running ones counted, 10 of 26 answers run past 16
    # tokens, and only one more fits.
    assert admitted() == 11
    monkeypatch.setattr(Lengths, "running", lambda self, written: None)
    assert admitted() == 60


def test_footprints_round_up_to_the_servers_kv_blocks() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    reading = load("a", capacity=1024)
    sched.on_load(server, dataclasses.replace(reading, kv_block_tokens=128))
    learn(sched, [100] * lengths.MIN_SAMPLES)
    q = Queues(sched, {"short": (150, [sample(i, prompt=50, max_tokens=200)
                                       for i in range(20)])})
    # 50 prompt + up to 87.5 written before the answer ends at 100: 137.5 tokens, held as
    # two 128-token blocks. Four fit in 1,024, not seven.
    assert len(q.fill([server])) == 4


def test_unknown_capacity_falls_back_to_partition_concurrency() -> None:
    q = Queues(AdaptiveScheduler(), {"short": (5, [sample(i) for i in range(20)])})
    assert len(q.fill([ServerState("a")])) == 5


def test_a_single_request_larger_than_the_target_still_runs_on_an_idle_server() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=100))
    q = Queues(sched, {"long": (4, [sample(i, "long", prompt=500) for i in range(3)])})
    assert len(q.fill([server])) == 1


def test_long_requests_keep_flowing_beside_short_ones() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=20_000))
    q = Queues(sched, {"short": (150, [sample(i, max_tokens=200) for i in range(300)]),
                       "long": (32, [sample(i, "long", max_tokens=2000) for i in range(30)])})
    admitted = [n for n, _ in q.fill([server])]
    # Both start at once, the long answers (the longer tail) first.
    assert admitted[0] == "long"
    assert admitted[:4].count("short") >= 1
    assert admitted.count("long") >= 2
    assert admitted.count("short") >= 5


def test_the_partition_with_the_longer_tail_drains_first() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    # No KV limit; the server runs 16 at once, so 16 + SLOT_QUEUE are sent.
    sched.on_load(server, dataclasses.replace(load("a", capacity=None), max_running=16))
    # The same mean length (100), but one long answer in ten runs to 505 tokens.
    learn(sched, [100] * 40, cat="s")
    learn(sched, [55] * 36 + [505] * 4, cat="l")
    q = Queues(sched, {"short": (50, [sample(i, cat="s", max_tokens=1000) for i in range(40)]),
                       "long": (50, [sample(i, "long", cat="l", max_tokens=1000)
                                     for i in range(40)])})
    sent = [n for n, _ in q.fill([server])]
    assert len(sent) == 16 + adaptive.SLOT_QUEUE
    while q.q["short"] or q.q["long"]:  # the oldest request ends, the next is picked
        oldest = min(("short", "long"), key=lambda k: int(
            q.flight[k][0][0].id.split("-")[1]) if q.flight[k] else 10**9)
        q.finish(oldest, 100)
        sent += [n for n, _ in q.fill([server])]
    # Both kept flowing, but the long queue emptied well before the short one.
    assert sent[:17].count("short") >= 5
    last_long = max(i for i, n in enumerate(sent) if n == "long")
    last_short = max(i for i, n in enumerate(sent) if n == "short")
    assert last_long < last_short - 5


def test_work_goes_to_the_server_with_the_most_free_expected_capacity() -> None:
    sched = AdaptiveScheduler()
    big, small = ServerState("big"), ServerState("small")
    sched.on_load(big, load("big", capacity=3000))
    sched.on_load(small, load("small", capacity=1000))
    learn(sched, [100] * lengths.MIN_SAMPLES)
    q = Queues(sched, {"short": (150, [sample(i) for i in range(40)])})
    # 100 + 75 tokens each at most (the last look-ahead point before the answers end):
    # 17 fit on the big server, 5 on the small one.
    admitted = [url for _, url in q.fill([big, small])]
    assert admitted.count("big") == 17 and admitted.count("small") == 5
    small.down_since = 1.0  # a server that goes down takes no new work
    for _ in range(4):
        q.finish("short", 100)
    assert all(url == "big" for _, url in q.fill([big, small]))


# --- feedback -----------------------------------------------------------------------

def full(capacity: int = 1000) -> tuple[AdaptiveScheduler, ServerState, list[str]]:
    """An adaptive scheduler whose one server is filled to its target."""
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append)
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=capacity))
    Queues(sched, {"short": (150, [sample(i) for i in range(50)])}).fill([server])
    return sched, server, logs


def test_backs_off_when_preemptions_outrun_the_requests_finished() -> None:
    sched, server, logs = full()
    slack = adaptive.PREEMPT_SLACK
    sched.on_load(server, load("a", preempt=slack, waiting=1))  # a few are tolerated
    assert sched.targets()["a"] == 1000.0
    sched.on_load(server, load("a", preempt=slack + 1, waiting=1))
    target = 1000.0 * adaptive.BACK_OFF_PREEMPT
    assert sched.targets()["a"] == pytest.approx(target)
    assert f"{slack + 1} preemption(s)" in logs[-1]
    # What was admitted before the back-off still has to settle: no second one at once.
    total = 2 * slack + 2
    for _ in range(int(adaptive.SETTLE_S / 0.5)):  # readings 0.5 s apart
        sched.on_load(server, load("a", preempt=total, waiting=1))
        assert sched.targets()["a"] == pytest.approx(target)
    sched.on_load(server, load("a", preempt=total, waiting=1))
    assert sched.targets()["a"] == pytest.approx(target * adaptive.BACK_OFF_PREEMPT)


def test_preemptions_in_proportion_to_finished_requests_are_tolerated() -> None:
    sched, server, _ = full()
    for i in range(40):
        sched.ended(sample(i), server, 50)
    allowed = int(adaptive.PREEMPT_OK * 40 + adaptive.PREEMPT_SLACK)
    sched.on_load(server, load("a", preempt=allowed, waiting=1))
    assert sched.targets()["a"] == 1000.0
    sched.on_load(server, load("a", preempt=allowed + 2, waiting=1))
    assert sched.targets()["a"] < 1000.0


def test_backs_off_when_the_server_queue_grows() -> None:
    sched, server, logs = full()
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK, usage=1.0))  # short: fine
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK + 1, usage=1.0))
    assert sched.targets()["a"] == pytest.approx(1000.0 * adaptive.BACK_OFF_QUEUE)
    assert "queue growing" in logs[-1]
    # Requests preempted back into the queue are judged as preemptions, not queue growth.
    before = sched.targets()["a"]
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK + 3, preempt=1, usage=1.0))
    assert sched.targets()["a"] == before


def roomy() -> tuple[AdaptiveScheduler, ServerState, Queues, list[str]]:
    """A server with room in its cache for all of 150 in flight, lengths learned."""
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append)
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=100_000))
    learn(sched, [50] * lengths.MIN_SAMPLES)
    return sched, server, Queues(sched, {"short": (150, [sample(i) for i in range(200)])}), logs


def test_a_queue_while_the_cache_has_room_caps_requests_at_what_the_server_runs() -> None:
    sched, server, q, logs = roomy()
    assert len(q.fill([server])) == 150  # the cache has room for all: the partition limits
    # The server runs 128 at once (its own max_num_seqs) and queues the rest: once is not
    # yet evidence (a queue the engine clears within a step), twice in a row is.
    sched.on_load(server, load("a", capacity=100_000, running=128, waiting=22, usage=0.2))
    assert not any("runs at most" in m for m in logs)
    sched.on_load(server, load("a", capacity=100_000, running=128, waiting=22, usage=0.2))
    assert "runs at most 128 requests" in logs[-1]
    assert sched.targets()["a"] == 100_000  # no KV back-off: the cache is not the limit
    for _ in range(40):
        q.finish("short", 50)
    assert len(q.fill([server])) == 128 + adaptive.SLOT_QUEUE - 110
    # Restarted with a higher limit, it runs what was sent beyond the old one: the limit
    # rises to that, and the next one sent beyond it probes for more.
    sched.on_load(server, load("a", capacity=100_000, running=129, waiting=0, usage=0.3))
    assert len(q.fill([server])) == 129 + adaptive.SLOT_QUEUE - (128 + adaptive.SLOT_QUEUE)


def test_requests_not_yet_answering_are_held_to_a_few_per_server() -> None:
    sched, server, q, _ = roomy()
    # Before anything answers, only a few go: the first burst arrives as fast as the
    # server prefills, not all at once.
    assert len(q.fill([server], answer=False)) == adaptive.UNANSWERED
    assert q.fill([server], answer=False) == []
    for s, _ in q.flight["short"][:5]:
        sched.books.flights[s.id].written = 1  # five first tokens: five more may go
    assert len(q.fill([server], answer=False)) == 5
    other = ServerState("b")  # the window is per server
    assert len(q.fill([server, other], answer=False)) == adaptive.UNANSWERED


def test_requests_sent_beyond_the_running_limit_are_called_back_newest_first() -> None:
    sched, server, q, logs = roomy()
    q.fill([server], answer=False)
    assert sched.recall(server) == []  # no limit known yet
    for s, _ in q.flight["short"][:10]:
        sched.books.flights[s.id].written = 3  # these have begun to answer
    q.fill([server], answer=False)
    assert server.in_flight == 10 + adaptive.UNANSWERED
    for _ in range(adaptive.SLOT_READINGS):
        sched.on_load(server, load("a", capacity=100_000, running=10,
                                   waiting=adaptive.UNANSWERED, usage=0.2))
    back = sched.recall(server)
    # Room for 10 running + SLOT_QUEUE: the newest of those not answering come back.
    assert adaptive.SLOT_QUEUE == 1
    newest = 10 + adaptive.UNANSWERED - 1
    assert back == [f"short-{i}" for i in range(newest, 10, -1)]
    assert f"calling back {len(back)}" in logs[-1]
    # Fewer waiting than sent beyond the limit: the rest may still be in prefill.
    sched.on_load(server, load("a", capacity=100_000, running=10, waiting=5, usage=0.2))
    assert sched.recall(server) == [f"short-{i}" for i in range(newest, newest - 4, -1)]


def test_a_published_running_limit_needs_no_learning() -> None:
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append)
    server = ServerState("a")
    reading = dataclasses.replace(load("a", capacity=100_000), max_running=20)
    sched.on_load(server, reading)
    assert "at most 20 requests at once (published)" in logs[-1]
    q = Queues(sched, {"short": (150, [sample(i) for i in range(200)])})
    assert len(q.fill([server])) == 20 + adaptive.SLOT_QUEUE


def test_pushes_up_when_calm_learned_at_target_and_the_server_has_room() -> None:
    sched, server, logs = full()
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK, usage=1.0))
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK + 1, usage=1.0))  # a back-off
    before = sched.targets()["a"]
    # Readings alone do not raise it: the projection still stands on the cautious prior.
    for _ in range(int(adaptive.COOL_DOWN_S / 0.5) + 1):
        sched.on_load(server, load("a", waiting=0, usage=0.6))
    assert sched.targets()["a"] == before
    learn(sched, [400] * lengths.MIN_SAMPLES)  # answers run long: still at target
    sched.on_load(server, load("a", waiting=0, usage=0.6))
    assert sched.targets()["a"] == before  # nothing finished here since the last change
    for i in range(adaptive.PUSH_EVIDENCE):
        sched.ended(sample(100 + i), server, 400)
    sched.on_load(server, load("a", waiting=0, usage=0.6))
    assert sched.targets()["a"] == pytest.approx(before * adaptive.PUSH_UP)
    assert "server queue 0" in logs[-1]
    # A queue at the server and a full cache: it has all it can take.
    for i in range(adaptive.PUSH_EVIDENCE):
        sched.ended(sample(200 + i), server, 400)
    for _ in range(int(adaptive.COOL_DOWN_S / 0.5) + 1):
        sched.on_load(server, load("a", waiting=1, usage=1.0))
    assert sched.targets()["a"] == pytest.approx(before * adaptive.PUSH_UP)
    # A queue, but KV usage below target (requests still in prefill): room to grow.
    sched.on_load(server, load("a", waiting=1, usage=0.5))
    assert sched.targets()["a"] == pytest.approx(before * adaptive.PUSH_UP ** 2)


def test_no_push_up_while_the_client_does_not_use_its_budget() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    for _ in range(int(adaptive.COOL_DOWN_S / 0.5) + 2):
        sched.on_load(server, load("a", capacity=1000, waiting=0, usage=0.1))
    assert sched.targets()["a"] == 1000.0


def test_the_target_stays_within_its_bounds() -> None:
    sched, server, _ = full()
    for i in range(200):
        sched.on_load(server, load("a", preempt=100 * (i + 1)))
    assert sched.targets()["a"] == pytest.approx(1000.0 * adaptive.FACTOR_MIN)


def test_a_queue_with_the_cache_full_is_no_evidence_of_a_running_limit() -> None:
    """The issue's case: 9 running, 3 waiting, KV usage 94% — the cache binds; nothing is
    learned, and what is in flight stays."""
    sched, server, q, logs = roomy()
    q.fill([server])
    for usage in (0.94, 0.94, 0.97, 0.85):
        sched.on_load(server, load("a", capacity=100_000, running=9, waiting=3, usage=usage))
    assert sched.control("a").max_running is None and sched.recall(server) == []
    assert not any("runs at most" in m for m in logs)
    # Room, then full, then room: evidence must come in a row.
    for usage in (0.5, 0.95, 0.5):
        sched.on_load(server, load("a", capacity=100_000, running=9, waiting=3, usage=usage))
    assert sched.control("a").max_running is None
    assert any("the cache binds, not a running limit" in m for m in logs)


def test_a_first_burst_still_being_admitted_is_no_evidence_of_a_running_limit() -> None:
    """Seen on the local engine (--max-num-seqs 16): a burst of 27 reads 8, then 11
    running with 16 waiting and the cache nearly empty while the engine admits it. A limit
    holds the count still; only the same count with a queue on consecutive readings is one."""
    sched, server, q, logs = roomy()
    q.fill([server])
    for running in (8, 11, 14):
        sched.on_load(server, load("a", capacity=100_000, running=running, waiting=12,
                                   usage=0.04))
    assert sched.control("a").max_running is None
    assert not any("runs at most" in m for m in logs)
    sched.on_load(server, load("a", capacity=100_000, running=14, waiting=12, usage=0.04))
    assert sched.control("a").max_running == 14
    assert "runs at most 14 requests at once" in logs[-1]


def test_fast_start_trusts_a_low_kv_reading_until_the_first_sign_of_too_much() -> None:
    sched, server, logs = full()
    # Nothing learned: the projection expects every answer to run to max_tokens at once,
    # while the server reads 40% full with no queue: the target rises a step a reading.
    sched.on_load(server, load("a", usage=0.4))
    assert sched.targets()["a"] == pytest.approx(1000.0 * adaptive.FAST_START_STEP)
    assert "fast start" in logs[-1]
    sched.on_load(server, load("a", usage=0.9))  # full enough: no further step
    assert sched.targets()["a"] == pytest.approx(1000.0 * adaptive.FAST_START_STEP)
    # The first back-off ends the fast start for good.
    sched.on_load(server, load("a", usage=0.5, preempt=0))
    sched.on_load(server, load("a", usage=0.5, preempt=50))
    after = sched.targets()["a"]
    assert after < 1000.0 * adaptive.FAST_START_STEP ** 2
    for _ in range(3):
        sched.on_load(server, load("a", usage=0.3, preempt=50))
    assert sched.targets()["a"] == after


def test_a_resumed_run_starts_from_the_target_the_last_one_ended_with() -> None:
    logs: list[str] = []
    first = AdaptiveScheduler(log=logs.append)
    first.control("a").factor = 1.6
    second = AdaptiveScheduler(log=logs.append)
    second.restore(first.state())
    second.on_load(ServerState("a"), load("a", capacity=1000, usage=0.1))
    assert second.targets()["a"] == pytest.approx(1600.0)  # no fast start on top of it
    assert "as the last run ended" in logs[-2]
    second.restore({"b": 99.0})  # out of range: ignored
    assert "b" not in second.targets()


def test_a_resumed_run_starts_at_capacity_at_least() -> None:
    """The restart shape of the workload suite: the first half ended at x0.86 after
    back-offs in its tail; resumed there, the second half ran at 0.85x the static's tokens
    per step with a fifth of its preemptions. A fresh run reaches x1.0 once lengths are
    learned; a resumed one, which has them, starts there at least."""
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append)
    sched.restore({"a": 0.86})
    sched.on_load(ServerState("a"), load("a", capacity=1000, usage=0.1))
    assert sched.targets()["a"] == pytest.approx(1000.0 * max(0.86, adaptive.RESTORE_FLOOR))
    assert adaptive.RESTORE_FLOOR == 1.0
    assert "(×0.86, raised)" in logs[-2]


def test_a_shared_system_prompt_counts_once_per_server() -> None:
    """The server's prefix cache holds one copy of a system prompt every request opens
    with: requests sharing one fit more of them than requests with a prompt each."""

    def with_system(i: int, system: str) -> Sample:
        msgs = ({"role": "system", "content": system}, {"role": "user", "content": "q" * 100})
        return Sample(id=f"short-{i}", category="c", partition="short", messages=msgs,
                      max_tokens=100, prompt_tokens=1100)

    def admitted(shared: bool) -> int:
        sched = AdaptiveScheduler()
        server = ServerState("a")
        sched.on_load(server, load("a", capacity=20_000))
        learn(sched, [50] * lengths.MIN_SAMPLES)
        samples = [with_system(i, "s" * 1000 if shared else f"{i:04d}" * 250)
                   for i in range(200)]
        return len(Queues(sched, {"short": (150, samples)}).fill([server]))

    # ~1,000 of each prompt's 1,100 tokens are its system prompt.
    assert admitted(shared=False) <= 20_000 // 1100
    assert admitted(shared=True) >= 4 * admitted(shared=False)


@pytest.mark.parametrize("interval", [0.5, 1.0, 2.0])
def test_the_rules_run_on_seconds_whatever_the_poll_interval(interval: float) -> None:
    # The fast start grows the target by a rate per second: one reading `interval` after
    # the last grows it by that many seconds' worth.
    sched, server, _ = full()
    t = sched.control("a").last_at
    assert t is not None
    sched.on_load(server, load("a", usage=0.3, at=t + interval))
    step = adaptive.FAST_START_STEP ** (interval / adaptive.STEP_EVERY_S)
    assert sched.targets()["a"] == pytest.approx(1000.0 * min(step, adaptive.FACTOR_MAX))
    # A back-off settles for SETTLE_S seconds, not for a number of readings.
    sched, server, _ = full()
    t = sched.control("a").last_at
    assert t is not None
    t += interval
    sched.on_load(server, load("a", preempt=50, waiting=1, at=t))  # the back-off
    backed_off, once = t, sched.targets()["a"]
    assert once < 1000.0
    preempt = 50
    while t + interval - backed_off <= adaptive.SETTLE_S:
        t, preempt = t + interval, preempt + 50
        sched.on_load(server, load("a", preempt=preempt, waiting=1, at=t))
        assert sched.targets()["a"] == once, f"a second back-off {t - backed_off} s after"
    sched.on_load(server, load("a", preempt=preempt + 50, waiting=1, at=t + interval))
    assert sched.targets()["a"] < once


@pytest.mark.parametrize("interval", [0.5, 1.0, 2.0])
def test_back_offs_are_as_strong_per_second_and_a_push_up_is_one_step_a_reading(
        interval: float) -> None:
    # A queue growing for `interval` seconds backs off as much as it would, read every
    # STEP_EVERY_S, over the same seconds.
    sched, server, _ = full()
    t = sched.control("a").last_at
    assert t is not None
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK, usage=1.0, at=t + interval))
    sched.on_load(server, load("a", waiting=adaptive.QUEUE_OK + 9, usage=1.0,
                               at=t + 2 * interval))
    steps = max(1.0, interval / adaptive.STEP_EVERY_S)
    assert sched.targets()["a"] == pytest.approx(1000.0 * adaptive.BACK_OFF_QUEUE ** steps)
    # Preemptions outrunning what finished for 6 s back off about as much read at any
    # interval as read every STEP_EVERY_S (4 steps there; counted a reading, 2 s readings
    # made 3).
    def backed_off_steps(every: float) -> float:
        sched, server, _ = full()
        t0 = sched.control("a").last_at
        assert t0 is not None
        for k in range(1, int(6.0 / every) + 1):
            sched.on_load(server, load("a", preempt=50 * k, waiting=1, at=t0 + every * k))
        return math.log(sched.targets()["a"] / 1000.0) / math.log(adaptive.BACK_OFF_PREEMPT)

    assert backed_off_steps(interval) == pytest.approx(
        backed_off_steps(adaptive.STEP_EVERY_S), abs=0.7)
    # Calm, at target, lengths learned: one reading after any interval pushes up one step.
    sched, server, _ = full()
    learn(sched, [400] * lengths.MIN_SAMPLES)
    for i in range(adaptive.PUSH_EVIDENCE):
        sched.ended(sample(100 + i), server, 400)
    t = sched.control("a").last_at
    assert t is not None
    sched.on_load(server, load("a", waiting=0, usage=0.6, at=t + interval))
    assert sched.targets()["a"] == pytest.approx(1000.0 * adaptive.PUSH_UP)


def long_prompts(prompt: int, n: int) -> tuple[AdaptiveScheduler, ServerState, list[str]]:
    """A cache of 8,192 tokens, `n` prompts of `prompt` tokens sent, none answering yet."""
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append, initial_factor=2.0)
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=8192, running=0, at=0.0))
    q = Queues(sched, {"main": (n, [sample(i, "main", prompt=prompt, max_tokens=64)
                                    for i in range(n)])})
    assert len(q.fill([server], answer=False)) == n
    return sched, server, logs


def test_a_queue_of_prompts_the_free_cache_cannot_hold_is_no_running_limit() -> None:
    """3 running, 4 waiting, KV usage 76% on readings in a row — under the 80% rule, yet
    the 1,966 tokens free hold none of the 2,000-token prompts that wait: the cache binds."""
    sched, server, logs = long_prompts(2000, 7)
    for k in range(4):
        sched.on_load(server, load("a", capacity=8192, running=3, waiting=4, usage=0.76,
                                   at=1.0 + k))
    assert sched.control("a").max_running is None, logs
    # With room for the largest prompt that waits, the same queue is a limit.
    for k in range(adaptive.SLOT_READINGS):
        sched.on_load(server, load("a", capacity=8192, running=3, waiting=4, usage=0.70,
                                   at=5.0 + k))
    assert sched.control("a").max_running == 3


# (running, waiting, KV usage) every 0.5 s, as the local engine read in the workload suite's
# prefill shape at cache size (prompts of 800-1,400 tokens, 8,192 KV tokens, 2,048 tokens a
# step) before adaptive learned a limit of 5 from it.
PREFILL_BOUND = [(6, 1, 0.84), (5, 0, 0.73), (4, 1, 0.59), (5, 0, 0.75), (5, 1, 0.7),
                 (5, 2, 0.76), (7, 1, 0.98), (6, 0, 0.81), (5, 2, 0.73), (5, 2, 0.73),
                 (6, 1, 0.84), (6, 2, 0.83), (6, 1, 0.83), (6, 2, 0.78), (5, 2, 0.73),
                 (6, 3, 0.87), (5, 3, 0.68), (6, 3, 0.83), (5, 2, 0.71), (5, 2, 0.78),
                 (5, 3, 0.84), (5, 3, 0.78), (4, 4, 0.6), (5, 4, 0.75), (5, 4, 0.73)]


@pytest.mark.parametrize("poll_s", [0.5, 1.0, 2.0])
def test_a_queue_for_the_prefill_budget_is_no_running_limit(poll_s: float) -> None:
    """The server prefills as fast as its token budget lets it and queues the rest with
    room in its cache, running 4 to 7 as prompts come and go. Two readings alike (5 running,
    4 waiting, KV 73-75%) made a limit of 5 (the suite learned 5 at every interval). A limit
    is a ceiling: a count under what the server ran in the last seconds is none."""
    sched, server, logs = long_prompts(1100, 10)
    every = round(poll_s / 0.5)
    for k, (running, waiting, usage) in enumerate(PREFILL_BOUND[::every]):
        sched.on_load(server, load("a", capacity=8192, running=running, waiting=waiting,
                                   usage=usage, at=1.0 + k * poll_s))
    assert sched.control("a").max_running is None, logs
    # Held at the top of what it ran, a window long: a limit.
    start = 1.0 + len(PREFILL_BOUND) * 0.5
    for k in range(int(adaptive.SLOT_WINDOW_S / poll_s) + 1):
        sched.on_load(server, load("a", capacity=8192, running=5, waiting=5, usage=0.70,
                                   at=start + k * poll_s))
    assert sched.control("a").max_running == 5


def test_the_ceiling_spans_ten_seconds_of_readings_at_any_interval() -> None:
    """At a 2 s poll a 5 s window held two or three readings, and prefill/cache still
    learned a limit of 5 (7 had run 6 s before): the window is 10 s."""
    sched, server, logs = long_prompts(1100, 10)
    for at, running, waiting in [(1.0, 7, 1), (3.0, 5, 4), (5.0, 5, 4), (7.0, 5, 4)]:
        sched.on_load(server, load("a", capacity=8192, running=running, waiting=waiting,
                                   usage=0.6, at=at))
    assert sched.control("a").max_running is None, logs
    sched.on_load(server, load("a", capacity=8192, running=5, waiting=4, usage=0.6, at=11.5))
    assert sched.control("a").max_running == 5  # 7 ran more than 10 s ago


def test_a_raised_limit_is_not_lowered_by_the_next_reading() -> None:
    sched, server, logs = long_prompts(100, 10)
    for k in range(12):
        sched.on_load(server, load("a", capacity=100_000, running=5, waiting=3, usage=0.2,
                                   at=1.0 + k * 0.5))
    assert sched.control("a").max_running == 5
    sched.on_load(server, load("a", capacity=100_000, running=6, waiting=3, usage=0.2, at=8.0))
    assert sched.control("a").max_running == 6
    for k in range(4):  # 6 ran within the window: 5 is under it
        sched.on_load(server, load("a", capacity=100_000, running=5, waiting=3, usage=0.2,
                                   at=8.5 + k * 0.5))
    assert sched.control("a").max_running == 6, logs


def test_a_limit_the_launch_profile_tells_caps_the_first_burst_and_is_never_learned_lower(
) -> None:
    """vLLM publishes no running limit, but a server draftgen launched runs the one its
    profile set (--max-num-seqs): it caps the first burst before any reading, and the
    prefill-bound readings that could learn 5 after a queue held 10 s leave it as told."""
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append, initial_factor=2.0)
    server = ServerState("a")
    sched.limit_known("a", 8, "the profile draftgen launched it with")
    assert "runs at most 8 requests at once (the profile draftgen launched it with)" in logs[-1]
    q = Queues(sched, {"main": (40, [sample(i, "main", prompt=1100, max_tokens=64)
                                     for i in range(40)])})
    # No reading yet: no capacity known, so only the running limit caps what goes out.
    assert len(q.fill([server], answer=True)) == 8 + adaptive.SLOT_QUEUE
    at = 0.0
    for running, waiting, usage in PREFILL_BOUND + [(5, 5, 0.70)] * 30:
        at += 0.5
        sched.on_load(server, load("a", capacity=8192, running=running, waiting=waiting,
                                   usage=usage, at=at))
    assert sched.control("a").max_running == 8, logs
    # What the server publishes still wins (SGLang's /v1/loads).
    sched.on_load(server, dataclasses.replace(load("a", capacity=8192, at=at + 1),
                                              max_running=12))
    assert sched.control("a").max_running == 12

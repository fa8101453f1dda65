"""Scheduling policies on plain data: no server, no clock needed."""

from __future__ import annotations

import dataclasses
from collections import deque

from draftgen.sample import Sample
from draftgen.schedule.adaptive import AdaptiveScheduler
from draftgen.schedule.base import PartitionView, Scheduler
from draftgen.schedule.load import ServerLoad
from draftgen.schedule.static import StaticScheduler
from draftgen.serverpool import ServerState


def sample(i: int, part: str = "short", prompt: int = 100, max_tokens: int = 400,
           cat: str = "c") -> Sample:
    return Sample(id=f"{part}-{i}", category=cat, partition=part, messages=(),
                  max_tokens=max_tokens, prompt_tokens=prompt)


def load(url: str, *, capacity: int | None = 1000, waiting: int = 0, preempt: int = 0,
         usage: float | None = 0.5, running: int = 1) -> ServerLoad:
    return ServerLoad(url=url, at=0.0, kv_capacity_tokens=capacity, kv_used_tokens=None,
                      kv_usage=usage, running=running, waiting=waiting,
                      preemptions_total=preempt, generation_tokens_total=None,
                      engine_steps_total=None, source="test", missing=())


class Queues:
    """A minimal stand-in for the runner's queues, driving a scheduler to a fixed point."""

    def __init__(self, sched: Scheduler, parts: dict[str, tuple[int, list[Sample]]]) -> None:
        self.sched = sched
        self.conc = {k: v[0] for k, v in parts.items()}
        self.q = {k: deque(v[1]) for k, v in parts.items()}
        self.flight: dict[str, list[tuple[Sample, ServerState]]] = {k: [] for k in parts}

    def views(self) -> list[PartitionView]:
        return [PartitionView(k, self.conc[k], 400, len(q), q[0] if q else None,
                              len(self.flight[k])) for k, q in self.q.items()]

    def fill(self, servers: list[ServerState]) -> list[tuple[str, str]]:
        admitted = []
        while (picked := self.sched.pick(self.views(), servers)) is not None:
            name, server = picked
            s = self.q[name].popleft()
            server.in_flight += 1
            self.sched.started(s, server)
            self.flight[name].append((s, server))
            admitted.append((name, server.url))
        return admitted

    def finish(self, name: str, output_tokens: int) -> None:
        s, server = self.flight[name].pop(0)
        server.in_flight -= 1
        self.sched.ended(s, server, output_tokens)


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


def test_adaptive_admits_by_expected_footprint_against_capacity() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=1000))
    q = Queues(sched, {"short": (150, [sample(i) for i in range(20)])})
    # Prior: half of max_tokens (200) + 100 prompt = 300 tokens each; 3 fit in 1,000.
    assert len(q.fill([server])) == 3
    # Answers turn out short (50 tokens): footprints shrink to 150 and more fit.
    for _ in range(3):
        q.finish("short", 50)
    assert len(q.fill([server])) == 6
    assert sched.targets() == {"a": 1000.0}


def test_unknown_capacity_falls_back_to_partition_concurrency() -> None:
    q = Queues(AdaptiveScheduler(), {"short": (5, [sample(i) for i in range(20)])})
    assert len(q.fill([ServerState("a")])) == 5


def test_a_single_request_larger_than_the_target_still_runs_on_an_idle_server() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=100))
    q = Queues(sched, {"long": (4, [sample(i, "long", prompt=500) for i in range(3)])})
    assert len(q.fill([server])) == 1


def test_feedback_backs_off_on_preemptions_and_queue_growth_and_pushes_up_when_dry() -> None:
    logs: list[str] = []
    sched = AdaptiveScheduler(log=logs.append)
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=1000, preempt=0))
    q = Queues(sched, {"short": (150, [sample(i) for i in range(50)])})
    q.fill([server])  # the budget is full now
    sched.on_load(server, load("a", preempt=3))
    assert sched.targets()["a"] == 800.0
    assert "3 preemption(s)" in logs[-1]
    sched.on_load(server, load("a", preempt=5))  # the same burst: no second back-off
    assert sched.targets()["a"] == 800.0
    sched.on_load(server, load("a", preempt=5, waiting=5))
    sched.on_load(server, load("a", preempt=5, waiting=9))
    assert sched.targets()["a"] < 800.0 and "queue growing" in logs[-1]
    before = sched.targets()["a"]
    # Dry queue and spare KV, but only after a few calm readings does the target rise.
    for _ in range(4):
        sched.on_load(server, load("a", preempt=5, waiting=0, usage=0.6))
        assert sched.targets()["a"] == before
    sched.on_load(server, load("a", preempt=5, waiting=0, usage=0.6))
    assert sched.targets()["a"] > before and "queue dry" in logs[-1]


def test_no_push_up_while_the_client_does_not_use_its_budget() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=1000))
    sched.on_load(server, load("a", capacity=1000, waiting=0, usage=0.1))
    assert sched.targets()["a"] == 1000.0


def test_long_requests_keep_flowing_beside_short_ones() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    sched.on_load(server, load("a", capacity=10_000))
    q = Queues(sched, {"short": (150, [sample(i, max_tokens=200) for i in range(300)]),
                       "long": (32, [sample(i, "long", max_tokens=2000) for i in range(30)])})
    admitted = [n for n, _ in q.fill([server])]
    # Remaining work is ~9,000 short vs ~33,000 long tokens: long is not left for the end.
    assert admitted.count("long") >= 3
    assert admitted.count("short") >= 10


def test_work_goes_to_the_server_with_the_most_free_expected_capacity() -> None:
    sched = AdaptiveScheduler()
    big, small = ServerState("big"), ServerState("small")
    sched.on_load(big, load("big", capacity=3000))
    sched.on_load(small, load("small", capacity=1000))
    q = Queues(sched, {"short": (150, [sample(i) for i in range(40)])})
    admitted = [url for _, url in q.fill([big, small])]
    assert admitted.count("big") == 10 and admitted.count("small") == 3
    small.down_since = 1.0
    for _ in range(2):
        q.finish("short", 200)
    assert all(url == "big" for _, url in q.fill([big, small]))


def test_footprints_round_up_to_the_servers_kv_blocks() -> None:
    sched = AdaptiveScheduler()
    server = ServerState("a")
    reading = load("a", capacity=1024)
    sched.on_load(server, dataclasses.replace(reading, kv_block_tokens=128))
    q = Queues(sched, {"short": (150, [sample(i, prompt=50, max_tokens=200)
                                       for i in range(20)])})
    # 50 prompt + 100 expected = 150 tokens, held as two 128-token blocks: 4 fit, not 6.
    assert len(q.fill([server])) == 4

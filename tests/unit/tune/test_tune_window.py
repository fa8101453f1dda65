"""A window of the job's own requests: what is sent, how much at once, what is counted."""

from __future__ import annotations

from typing import Any

import pytest

from draftgen.engines.load import ServerLoad
from draftgen.errors import RunError
from draftgen.sample import Message, Sample, base_body
from draftgen.tune.window import interleaved, measure_window
from helpers.fakeserver import FakeServer, Reply, completion


def sample(i: int, category: str, partition: str) -> Sample:
    messages: tuple[Message, ...] = ({"role": "system", "content": f"sys {category}"},
                                     {"role": "user", "content": f"{category} prompt {i}"})
    return Sample(f"{category}-{i}", category, partition, messages,
                  max_tokens=64 if partition == "short" else 128, seed=1000 + i)


SAMPLES = [sample(i, c, "long" if c == "essay" else "short")
           for c in ("chat", "code", "essay") for i in range(4)]


def streaming(body: dict[str, Any]) -> Reply:
    reply = completion(["tok "] * 6)
    # A pause between tokens, as decoding takes: the window sees requests in flight.
    steps: list[Any] = []
    for step in reply.steps:
        steps += [step, 0.01]
    return Reply(steps=steps)


def test_interleaved_takes_each_category_in_turn() -> None:
    assert [s.id for s in interleaved(SAMPLES)[:4]] == ["chat-0", "code-0", "essay-0", "chat-1"]


async def test_a_window_sends_the_jobs_requests_at_each_partitions_concurrency() -> None:
    base = base_body("m", {"temperature": 0.7, "seed": 5,
                           "extra_body": {"logit_bias": {"2": 4.0}}})
    async with FakeServer(responder=streaming) as server:
        window = await measure_window(server.url, SAMPLES, base, {"short": 2, "long": 1},
                                      seconds=0.6, warmup_s=0.2)
    bodies = [r.body for r in server.seen]
    assert server.max_active == 3
    assert all("seed" not in b for b in bodies)
    assert all(b["temperature"] == 0.7 and b["logit_bias"] == {"2": 4.0} for b in bodies)
    by_prompt = {b["messages"][-1]["content"]: b for b in bodies}
    assert by_prompt["essay prompt 0"]["max_tokens"] == 128
    assert by_prompt["chat prompt 0"]["max_tokens"] == 64
    assert by_prompt["chat prompt 0"]["messages"][0] == {"role": "system", "content": "sys chat"}
    assert window.tok_s > 0 and window.completed > 0 and window.failed == 0
    assert set(window.lengths) <= {"chat/short", "code/short", "essay/long"}
    assert all(n == 6 for lengths in window.lengths.values() for n in lengths)
    speed = window.speed()
    assert speed is not None and max(b for b, _ in speed.points) <= 3


async def test_failed_requests_are_counted_and_a_run_error_stops_the_window() -> None:
    def refuse(body: dict[str, Any]) -> Reply:
        return Reply(status=400, body=b'{"error": {"message": "bad", "code": 400}}')

    async with FakeServer(responder=refuse) as server:
        window = await measure_window(server.url, SAMPLES[:2], {"model": "m"}, {"short": 1},
                                      seconds=0.2, warmup_s=0.0)
    assert window.tok_s == 0 and window.failed > 0 and window.errors

    def unknown_model(body: dict[str, Any]) -> Reply:
        return Reply(status=404, body=b'{"error": {"message": "The model `m` does not exist."}}')

    async with FakeServer(responder=unknown_model) as server:
        with pytest.raises(RunError):
            await measure_window(server.url, SAMPLES[:2], {"model": "m"}, {"short": 1},
                                 seconds=0.3, warmup_s=0.0)


async def test_a_window_keeps_the_peaks_of_the_servers_load() -> None:
    # Readings as the load poller gives them: KV usage rising, then a preemption.
    readings = iter([(0.10, 2, 0, 5), (0.40, 3, 1, 5), (0.35, 3, 4, 7)])
    seen: list[float] = []

    async def load() -> ServerLoad | None:
        kv, running, waiting, preempted = next(readings, (0.20, 1, 0, 7))
        seen.append(kv)
        return ServerLoad("u", 0.0, 1000, None, kv, running, waiting, preempted, None, None,
                          "vllm /metrics", ())

    async with FakeServer(responder=streaming) as server:
        window = await measure_window(server.url, SAMPLES, {"model": "m"}, {"short": 1},
                                      seconds=1.2, warmup_s=0.1, load=load)
    assert len(seen) >= 3
    assert window.kv_peak == 0.40 and window.running_peak == 3 and window.waiting_peak == 4
    assert window.preempted == 2  # counted from the first reading of the window
    async with FakeServer(responder=streaming) as server:
        unread = await measure_window(server.url, SAMPLES[:2], {"model": "m"}, {"short": 1},
                                      seconds=0.2, warmup_s=0.0)
    assert unread.kv_peak is None and unread.preempted is None


async def test_the_warmup_is_no_part_of_the_decode_intervals() -> None:
    # One long answer that decodes slowly at first (the opening burst: it shares the engine
    # with prefills), then fast: its interval must start at the warmup's end and count only
    # the tokens streamed after it.
    def slow_then_fast(body: dict[str, Any]) -> Reply:
        reply = completion(["tok "] * 40)
        steps: list[Any] = []
        for i, step in enumerate(reply.steps):
            steps += [step, 0.1 if i < 4 else 0.01]
        return Reply(steps=steps)

    async with FakeServer(responder=slow_then_fast) as server:
        window = await measure_window(server.url, SAMPLES[:1], {"model": "m"}, {"short": 1},
                                      seconds=0.3, warmup_s=0.35)
    assert window.intervals, "the answer outlasted the warmup"
    start, end, tokens = window.intervals[0]
    assert end - start <= 0.3 + 0.05
    # Counting from the first token would take in ~4 slow tokens (10 tok/s); after the warmup
    # the rate is the fast one.
    assert tokens / (end - start) > 40
    assert tokens < 40


async def test_answers_longer_than_the_window_are_counted_as_unfinished() -> None:
    # Short answers finish; the essays outlast the window. Their lengths are not in the
    # window's (it never saw one end), but the window says they were there.
    def by_partition(body: dict[str, Any]) -> Reply:
        long = body["max_tokens"] == 128
        reply = completion(["tok "] * (60 if long else 3))
        steps: list[Any] = []
        for step in reply.steps:
            steps += [step, 0.05 if long else 0.01]
        return Reply(steps=steps)

    async with FakeServer(responder=by_partition) as server:
        window = await measure_window(server.url, SAMPLES, {"model": "m"},
                                      {"short": 2, "long": 1}, seconds=0.4, warmup_s=0.1)
    assert "essay/long" not in window.lengths
    assert window.unfinished.get("essay/long") == 1
    assert sum(len(v) for v in window.lengths.values()) == window.completed > 0

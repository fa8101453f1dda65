"""The runner end to end against a scripted server: outcomes, retries, resume, export."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from draftgen.errors import JobChangedError
from draftgen.export import ExportOptions, export_run
from draftgen.job import load_job
from draftgen.reporting.status import read_status
from draftgen.running import runner as runner_module
from draftgen.running.runner import RunOptions, run_job
from draftgen.running.state import RunState
from draftgen.schedule import adaptive
from draftgen.schedule.base import Scheduler
from helpers.fakeserver import FakeServer, Reply, chunk, completion, error_reply, sse, usage

JOB = """
model: fake
sampling: {{temperature: 0.0, seed: 3}}
partitions:
  short: {{max_tokens: 16, concurrency: {conc}}}
categories:
  - {{name: chat, source: {{path: chat.jsonl, id_field: id}}, partition: short,
     system_prompt: "Be brief."}}
multi_turn: {multi_turn}
client: {{{client}retry: {{max_attempts: 3, backoff_base_s: 0.001, backoff_max_s: 0.002}}}}
progress_interval_s: 1000
"""


def make_job(tmp_path: Path, rows: list[dict[str, Any]], *, conc: int = 4,
             multi_turn: str = "last", extra: str = "", client: str = "") -> Path:
    with open(tmp_path / "chat.jsonl", "wb") as f:
        for r in rows:
            f.write(orjson.dumps(r) + b"\n")
    p = tmp_path / "job.yaml"
    p.write_text(JOB.format(conc=conc, multi_turn=multi_turn, client=client) + extra)
    return p


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "messages": [{"role": "user", "content": f"question {i}"}]}
            for i in range(n)]


def last_user(body: dict[str, Any]) -> str:
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


def echo(body: dict[str, Any]) -> Reply:
    return completion([f"answer to {last_user(body)}"], completion_tokens=5)


async def run(job_path: Path, server: FakeServer, **kw: Any) -> Any:
    job = load_job(job_path)
    opts = RunOptions(out_dir=job_path.parent / "out", servers=[server.url], progress=False, **kw)
    return await run_job(job, opts)


async def test_full_run_records_everything_and_a_second_run_sends_nothing(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, rows(12), conc=3)
    async with FakeServer(responder=echo) as server:
        summary = await run(job, server)
        assert (summary.done, summary.failed, summary.pending, summary.sent) == (12, 0, 0, 12)
        assert server.max_active <= 3
        seen = len(server.seen)
        again = await run(job, server)
        assert again.sent == 0 and again.done == 12
        assert len(server.seen) == seen
    body = server.seen[0].body
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["max_tokens"] == 16 and body["temperature"] == 0.0 and body["seed"] == 3
    st = read_status(tmp_path / "out")
    assert (st.total, st.done, st.pending, st.output_tokens) == (12, 12, 0, 60)


async def test_transient_errors_are_retried_and_permanent_ones_recorded(tmp_path: Path) -> None:
    tries: collections.Counter[str] = collections.Counter()

    def flaky(body: dict[str, Any]) -> Reply:
        q = last_user(body)
        tries[q] += 1
        if q == "question 0":
            return error_reply(400, "This model's maximum context length is 16 tokens.")
        if q == "question 1":
            return Reply(status=504, body=b"gateway timeout")  # never recovers
        if tries[q] == 1:
            return Reply(status=500, body=b"oops")
        return echo(body)

    job = make_job(tmp_path, rows(5))
    async with FakeServer(responder=flaky) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (3, 2)
    assert tries["question 0"] == 1  # permanent: not retried
    assert tries["question 1"] == 3  # attempt limit
    assert tries["question 2"] == 2
    st = read_status(tmp_path / "out")
    assert st.failures == {"context_too_long": 1, "exhausted_retries": 1}

    async with FakeServer(responder=echo) as server:
        assert (await run(job, server)).sent == 0
        retried = await run(job, server, retry_failed=True)
        assert retried.sent == 2 and retried.done == 5
        assert sorted(last_user(s.body) for s in server.seen) == ["question 0", "question 1"]


async def test_multi_turn_all_regenerates_each_assistant_turn_in_order(tmp_path: Path) -> None:
    conv = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "second"}, {"role": "assistant", "content": "old2"}]
    job = make_job(tmp_path, [{"id": "a", "messages": conv}], multi_turn="all")
    async with FakeServer(responder=echo) as server:
        summary = await run(job, server)
        assert summary.done == 1
        assert [last_user(s.body) for s in server.seen] == ["first", "second"]
        assert server.seen[1].body["messages"][2] == {
            "role": "assistant", "content": "answer to first"}
    to = tmp_path / "sf.jsonl"
    export_run(tmp_path / "out", to, ExportOptions())
    row = orjson.loads(to.read_bytes())
    assert [(m["role"], m["content"]) for m in row["conversations"]] == [
        ("system", "Be brief."), ("user", "first"), ("assistant", "answer to first"),
        ("user", "second"), ("assistant", "answer to second")]


async def test_a_changed_job_is_refused_until_asked_to_redo(tmp_path: Path) -> None:
    job = make_job(tmp_path, rows(3))
    async with FakeServer(responder=echo) as server:
        await run(job, server)
        job.write_text(job.read_text().replace("temperature: 0.0", "temperature: 0.7"))
        with pytest.raises(JobChangedError, match="3 recorded sample"):
            await run(job, server)
        redo = await run(job, server, redo_changed=True)
        assert redo.sent == 3 and redo.done == 3
        assert server.seen[-1].body["temperature"] == 0.7


async def test_export_formats_reasoning_and_left_out_samples(tmp_path: Path) -> None:
    def replies(body: dict[str, Any]) -> Reply:
        q = last_user(body)
        if q == "question 0":  # truncated
            return completion(["cut"], finish="length")
        if q == "question 1":  # empty answer
            return completion([""], completion_tokens=0)
        steps = [chunk(role="assistant", reasoning="think", reasoning_key="reasoning"),
                 chunk("ok"), chunk(finish="stop"), usage(3, 2), b"data: [DONE]\n\n"]
        return Reply(steps=steps)

    job = make_job(tmp_path, rows(4))
    async with FakeServer(responder=replies) as server:
        await run(job, server)
    out = tmp_path / "out"
    s = export_run(out, tmp_path / "a.jsonl", ExportOptions())
    assert (s.exported, s.truncated, s.empty, s.failed, s.pending) == (2, 1, 1, 0, 0)
    first = orjson.loads((tmp_path / "a.jsonl").read_bytes().splitlines()[0])
    assert first["status"] == "success" and isinstance(first["id"], str)
    assert first["conversations"][-1]["content"] == "<think>\nthink\n</think>\n\nok"

    export_run(out, tmp_path / "b.jsonl", ExportOptions(reasoning="field"))
    msg = orjson.loads((tmp_path / "b.jsonl").read_bytes().splitlines()[0])["conversations"][-1]
    assert msg == {"role": "assistant", "content": "ok", "reasoning_content": "think"}

    s = export_run(out, tmp_path / "c.jsonl", ExportOptions("sharegpt", include_truncated=True))
    assert s.exported == 3
    conv = orjson.loads((tmp_path / "c.jsonl").read_bytes().splitlines()[0])["conversations"]
    assert [m["from"] for m in conv] == ["system", "human", "gpt"]

    s = export_run(out, tmp_path / "d.parquet", ExportOptions("parquet"))
    table = pq.read_table(tmp_path / "d.parquet")
    assert table.num_rows == s.exported == 2
    assert set(table.column("finish_reason").to_pylist()) == {"stop"}


async def test_an_error_inside_the_stream_is_retried(tmp_path: Path) -> None:
    calls = collections.Counter[str]()

    def replies(body: dict[str, Any]) -> Reply:
        calls["n"] += 1
        if calls["n"] == 1:
            return Reply(steps=[chunk("partial"), sse({"error": {"message": "engine died",
                                                                 "code": 500}})])
        return echo(body)

    job = make_job(tmp_path, rows(1))
    async with FakeServer(responder=replies) as server:
        summary = await run(job, server)
    assert summary.done == 1 and calls["n"] == 2
    st = read_status(tmp_path / "out")
    assert st.done == 1


async def test_a_server_outage_requeues_without_charging_retries(tmp_path: Path) -> None:
    state = {"down": True, "answered_while_down": 0}

    def outage(body: dict[str, Any]) -> Reply:
        if last_user(body) == "ping" and state["answered_while_down"] >= 3:
            state["down"] = False  # the server is back by the fourth probe
        if state["down"]:
            state["answered_while_down"] += 1
            return Reply(status=503, body=b"restarting")
        return echo(body)

    job = make_job(tmp_path, rows(4), conc=2)
    async with FakeServer(responder=outage) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (4, 0)
    st = read_status(tmp_path / "out")
    assert st.done == 4
    ledger = [orjson.loads(x) for x in (tmp_path / "out" / "ledger.jsonl").read_bytes().split()]
    # The 503s during the outage were not charged: each sample took one attempt.
    assert {e["attempts"] for e in ledger} == {1}
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    events = manifest["runs"][-1]["events"]
    assert any("down" in e for e in events) and any("up again" in e for e in events)
    # The first probe met the outage, the second found the server back.
    assert [last_user(s.body) for s in server.seen].count("ping") == 2


async def test_work_moves_off_a_server_that_goes_down_and_back_when_it_returns(
        tmp_path: Path) -> None:
    """Two servers; one goes down mid-run: its work moves to the other, nothing is lost or
    repeated, and once its probe succeeds it takes work again."""
    state = {"b_answered": 0, "a_since_b_down": 0}

    def slow_echo(body: dict[str, Any]) -> Reply:
        reply = echo(body)
        return Reply(steps=[0.1, *reply.steps])

    def a(body: dict[str, Any]) -> Reply:
        if state["b_answered"] >= 5:
            state["a_since_b_down"] += 1
        return slow_echo(body)

    def b(body: dict[str, Any]) -> Reply:
        if state["b_answered"] >= 5 and state["a_since_b_down"] < 15:
            return Reply(status=503, body=b"restarting")
        if last_user(body) != "ping":
            state["b_answered"] += 1
        return slow_echo(body)

    # With b down, a alone takes ~2 s for the rest: b's first probe (after 1 s) finds it back.
    job = load_job(make_job(tmp_path, rows(100), conc=4))
    async with FakeServer(responder=a) as server_a, FakeServer(responder=b) as server_b:
        opts = RunOptions(out_dir=tmp_path / "out", servers=[server_a.url, server_b.url],
                          progress=False)
        summary = await run_job(job, opts)
    assert (summary.done, summary.failed) == (100, 0)
    recs = [orjson.loads(x) for p in sorted((tmp_path / "out" / "shards").glob("*"))
            for x in p.read_bytes().splitlines()]
    assert sorted(r["id"] for r in recs) == sorted(f"chat-{i}" for i in range(100))
    by_server = collections.Counter(r["server"] for r in recs)
    assert by_server[server_a.url] > 15  # a took b's share while b was down
    assert by_server[server_b.url] > 5  # b finished more after it came back
    events = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())["runs"][-1]["events"]
    assert any(server_b.url in e and "down" in e for e in events)
    assert any(server_b.url in e and "up again" in e for e in events)


class SlotServer(FakeServer):
    """Runs at most `slots` requests at once and queues the rest without a byte, as a
    server whose own running limit binds; reports it like SGLang's /v1/loads but does not
    publish the limit (as vLLM does not)."""

    def __init__(self, slots: int) -> None:
        super().__init__(responder=lambda body: Reply(steps=[
            chunk("x"), 0.2, *completion(["y"], completion_tokens=2).steps]))
        self.loads = self.load_reading
        self._slots = asyncio.Semaphore(slots)
        self.running = self.waiting = 0

    def load_reading(self) -> dict[str, Any]:
        return {"loads": [{"num_running_reqs": self.running, "num_waiting_reqs": self.waiting,
                           "num_used_tokens": 10, "max_total_num_tokens": 100_000,
                           "token_usage": 0.0001}]}

    async def _play(self, request: Any, body: dict[str, Any]) -> Any:
        if last_user(body) == "ping":
            return await super()._play(request, body)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await super()._play(request, body)
        finally:
            self.running -= 1
            self._slots.release()


class PeakServer(SlotServer):
    """Answers a first token at once, then takes a second to finish; counts the most
    requests it held at once."""

    def __init__(self) -> None:
        super().__init__(slots=1000)
        self.responder = lambda body: Reply(steps=[
            chunk("x"), 1.0, *completion(["y"], completion_tokens=2).steps])
        self.peak = 0

    async def _play(self, request: Any, body: dict[str, Any]) -> Any:
        if last_user(body) != "ping":
            self.peak = max(self.peak, self.running + self.waiting + 1)
        return await super()._play(request, body)


async def test_a_first_token_lets_the_next_request_go_at_once(tmp_path: Path) -> None:
    """The adaptive scheduler holds a server to a few requests that have not begun to
    answer; each first token wakes the dispatcher, so the rest go before anything ends
    (and long before the next load reading)."""
    assert adaptive.UNANSWERED < 30
    job = load_job(make_job(tmp_path, rows(30), conc=30,
                            extra="scheduler: adaptive\npoll_interval_s: 30\n"))
    async with PeakServer() as server:
        opts = RunOptions(out_dir=tmp_path / "out", servers=[server.url], progress=False)
        summary = await run_job(job, opts)
    assert (summary.done, summary.failed) == (30, 0)
    assert server.peak == 30


async def test_requests_waiting_beyond_the_servers_running_limit_are_called_back(
        tmp_path: Path) -> None:
    """The first burst goes out before the limit is known; once it is learned, what waits
    beyond it comes back to the client's queue, and is sent again once: nothing lost, no
    attempt charged, nothing twice in the output."""
    job = load_job(make_job(tmp_path, rows(40), conc=30,
                            extra="scheduler: adaptive\npoll_interval_s: 0.05\n"))
    async with SlotServer(slots=4) as server:
        opts = RunOptions(out_dir=tmp_path / "out", servers=[server.url], progress=False)
        summary = await run_job(job, opts)
    assert (summary.done, summary.failed) == (40, 0)
    recs = [orjson.loads(x) for p in sorted((tmp_path / "out" / "shards").glob("*"))
            for x in p.read_bytes().splitlines()]
    assert sorted(r["id"] for r in recs) == sorted(f"chat-{i}" for i in range(40))
    assert {r["attempts"] for r in recs} == {1}
    events = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())["runs"][-1]["events"]
    assert any("runs at most 4 requests" in e for e in events)
    called_back = [e for e in events if "calling back" in e]
    assert called_back
    sent = [last_user(s.body) for s in server.seen if last_user(s.body) != "ping"]
    # The first burst (30) was more than 4 + 2; what came back was sent again.
    assert len(sent) > 40
    assert collections.Counter(sent).most_common(1)[0][1] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheduler", ["static", "adaptive"])
async def test_a_request_called_back_before_its_task_starts_is_sent_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheduler: str) -> None:
    """A call-back (or a hang, or a stop) can cancel a request task in the same turn of the
    event loop that created it, before its first step: its body never runs. What was taken
    for it is released all the same and the sample goes back to its queue — on the local
    engine such a call-back left five samples "in flight" forever (the run hung)."""
    states: list[RunState] = []

    class Recorded(RunState):
        def __init__(self) -> None:
            super().__init__()
            states.append(self)

    monkeypatch.setattr(runner_module, "RunState", Recorded)
    started = Scheduler.started
    called_back: list[str] = []

    def started_then_called_back(self: Scheduler, sample: Any, server: Any) -> Any:
        flight = started(self, sample, server)
        if len(called_back) < 3:
            # Queued now, this runs after dispatch created the task and before its first step.
            called_back.append(sample.id)
            asyncio.get_running_loop().call_soon(states[-1].recall, [sample.id])
        return flight

    monkeypatch.setattr(Scheduler, "started", started_then_called_back)
    job = make_job(tmp_path, rows(10), conc=4, extra=f"scheduler: {scheduler}\n")
    async with FakeServer(responder=echo) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed, summary.pending) == (10, 0, 0)
    assert len(called_back) == 3
    recs = [orjson.loads(x) for p in sorted((tmp_path / "out" / "shards").glob("*"))
            for x in p.read_bytes().splitlines()]
    assert sorted(r["id"] for r in recs) == sorted(f"chat-{i}" for i in range(10))
    sent = [last_user(s.body) for s in server.seen if last_user(s.body) != "ping"]
    assert sorted(sent) == sorted(f"question {i}" for i in range(10))  # none sent twice

"""Prompts against the server's context: exact counts from the server, shortened or set
aside before anything is sent, and the same decisions whether or not a server answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_runner import echo, last_user

from draftgen.job import load_job
from draftgen.planning.plan import Plan
from draftgen.planning.replan import fit_context, near_context
from draftgen.reporting.status import read_status
from draftgen.running.runner import RunOptions, run_job
from draftgen.sample import Sample
from helpers.fakeserver import FakeServer

JOB = """
model: fake
partitions:
  long: {{max_tokens: 600, concurrency: 4}}
categories:
  - {{name: chat, source: {{path: chat.jsonl, id_field: id}}, partition: long}}
over_context: {policy}
client: {{probe_timeout_s: 0.3, {client}retry: {{max_attempts: 2, backoff_base_s: 0.001}}}}
progress_interval_s: 1000
"""

# Characters of each prompt: the fake server counts one token per character, four times
# what the planner's chars/4 estimate says.
SIZES = {"fits": 100, "tight": 600, "no_room": 900, "over": 1500}


def make_job(tmp_path: Path, *, policy: str = "shorten", client: str = "") -> Path:
    with open(tmp_path / "chat.jsonl", "wb") as f:
        for name, n in SIZES.items():
            text = (name + " ") + "x" * (n - len(name) - 1)
            f.write(orjson.dumps({"id": name, "messages": [{"role": "user",
                                                            "content": text}]}) + b"\n")
    p = tmp_path / "job.yaml"
    p.write_text(JOB.format(policy=policy, client=client))
    return p


def chars(body: dict[str, Any]) -> int:
    return sum(len(m["content"]) for m in body["messages"])


async def run(job: Path, url: str) -> Any:
    return await run_job(load_job(job), RunOptions(job.parent / "out", servers=[url],
                                                   progress=False))


def reasons(out: Path) -> dict[str, str]:
    rows = [orjson.loads(x) for x in (out / "rejected.jsonl").read_bytes().splitlines()]
    names = list(SIZES)
    return {names[r["row"] - 1]: r["reason"] for r in rows}


async def test_the_servers_own_count_shortens_or_sets_aside_before_sending(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path)
    async with FakeServer(responder=echo, context_tokens=1000, tokenize=chars) as server:
        summary = await run(job, server.url)
    sent = {last_user(s.body).split()[0]: s.body["max_tokens"] for s in server.seen}
    # 600 counted tokens leave 400 of the context: sent with max_tokens 400, not 600.
    assert sent == {"fits": 600, "tight": 400}
    why = reasons(tmp_path / "out")
    assert why["no_room"].startswith("prompt_too_long: 900 prompt tokens + max_tokens 600")
    # Estimated at ~380 tokens, under twice the context: only the server's count says.
    assert why["over"].startswith("prompt_too_long: 1500 prompt tokens > the server's")
    assert (summary.done, summary.failed, summary.planned) == (2, 0, 2)
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert manifest["context"]["tokens"] == 1000
    assert manifest["context"]["prompt_tokens"]["chat-tight"] == 600


async def test_prompts_the_server_cannot_count_are_fitted_by_the_estimate_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """No /tokenize and no usage in a one-token completion: the count is missed, said once,
    and the plan's estimate decides: every prompt estimated under twice the context goes."""
    job = make_job(tmp_path)
    async with FakeServer(responder=echo, context_tokens=1000) as server:
        summary = await run(job, server.url)
    err = capsys.readouterr().err
    assert "3 long prompt(s) could not be counted by" in err
    assert "fitted by the plan's estimate" in err
    assert (summary.planned, summary.done) == (4, 4)  # this server refuses no length
    # The counts were asked as one-token completions, never as answers.
    counts = [s.body for s in server.seen if s.body["max_tokens"] == 1]
    assert len(counts) == 3 and all("stream" not in b for b in counts)


async def test_set_aside_policy_sends_nothing_that_would_be_cut_by_the_context(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, policy="set_aside")
    async with FakeServer(responder=echo, context_tokens=1000, tokenize=chars) as server:
        summary = await run(job, server.url)
    assert {last_user(s.body).split()[0] for s in server.seen} == {"fits"}
    assert sorted(reasons(tmp_path / "out")) == ["no_room", "over", "tight"]
    assert summary.done == 1


async def test_the_plan_does_not_change_with_whether_a_server_answers(tmp_path: Path) -> None:
    job = make_job(tmp_path, client="server_down_give_up_s: 0.5, ")
    out = tmp_path / "out"
    async with FakeServer(responder=echo, context_tokens=1000, tokenize=chars) as server:
        await run(job, server.url)
        url = server.url
    before = {p: (out / p).read_bytes() for p in ("plan.jsonl", "rejected.jsonl")}
    status = read_status(out)
    # Nothing left to send, and no server at that address any more.
    summary = await run(job, url)
    assert summary.sent == 0
    assert {p: (out / p).read_bytes() for p in before} == before
    again = read_status(out)
    assert (again.total, again.failed, again.rejected) == (status.total, status.failed,
                                                          status.rejected)


async def test_a_start_while_the_server_is_down_waits_and_sends_nothing_blind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    job = make_job(tmp_path, client="server_down_give_up_s: 1.2, ")
    async with FakeServer(responder=echo, context_tokens=1000, tokenize=chars) as server:
        url = server.url
    summary = await run(job, url)
    assert summary.exit_code == 3 and "no server answered" in (summary.stopped or "")
    assert (summary.sent, summary.failed) == (0, 0)
    assert "waiting for a server to answer" in capsys.readouterr().err
    # Up again: the same prompts are set aside as if it had answered the first time.
    async with FakeServer(responder=echo, context_tokens=1000, tokenize=chars) as server:
        summary = await run(job, server.url)
    assert (summary.done, summary.failed) == (2, 0)
    assert sorted(reasons(tmp_path / "out")) == ["no_room", "over"]


async def test_a_server_that_accepts_but_never_answers_is_reported_within_the_jobs_timeouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    job = make_job(tmp_path, client="server_down_give_up_s: 1, ")
    started = time.monotonic()
    try:
        summary = await run(job, f"http://127.0.0.1:{port}")
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
    assert time.monotonic() - started < 10  # probe_timeout_s 0.3, give-up 1 s
    assert summary.exit_code == 3 and summary.sent == 0
    err = capsys.readouterr().err
    assert "waiting for a server to answer" in err and "within 0.3s" in err


def sample(sid: str, prompt_tokens: int, max_tokens: int = 600) -> Sample:
    return Sample(sid, "c", "p", ({"role": "user", "content": "x"},), max_tokens,
                  prompt_tokens=prompt_tokens, source="s.jsonl:1")


def test_fit_context_keeps_done_samples_and_rejects_estimates_only_at_twice_the_context(
) -> None:
    samples = [sample("done", 5000), sample("est_ok", 1900), sample("est_bad", 2100)]
    plan = Plan(samples=samples, rejected=[], stats={}, token_count_label="estimate")
    fitted, todo, shortened = fit_context(plan, samples[1:], 1000, counts={}, keep={"done"})
    assert [s.id for s in fitted.samples] == ["done", "est_ok"]
    assert [s.id for s in todo] == ["est_ok"] and shortened == 0
    assert [r.reason.split(":")[0] for r in fitted.rejected] == ["prompt_too_long"]


def test_near_context_asks_only_about_prompts_that_might_not_fit() -> None:
    samples = [sample("short", 50), sample("long", 150)]
    # 50 estimated tokens are at most ~200 characters: 200 + 600 fits 1000.
    assert [s.id for s in near_context(samples, 1000, exact=False)] == ["long"]
    assert [s.id for s in near_context(samples, 700, exact=True)] == ["long"]

"""Runner behaviour under hangs, outages, secrets, over-long prompts and write errors."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from test_runner import echo, last_user, make_job, rows, run

from draftgen.errors import DiskError
from draftgen.job import load_job
from draftgen.reporting.status import read_status
from draftgen.running import monitor
from draftgen.running.progress import server_text
from draftgen.running.runner import RunOptions, run_job
from draftgen.running.stats import ServerSnapshot
from helpers.fakeserver import STALL, FakeServer, Reply, chunk, completion, error_reply

SECRET = "sk-test-5f2b9c0d1e"


async def test_a_hung_server_is_detected_by_the_watchdog_and_its_requests_requeued(
    tmp_path: Path,
) -> None:
    hung = {"left": 2}

    def replies(body: dict[str, Any]) -> Reply:
        # The first two requests start streaming, then the server stops producing tokens.
        if hung["left"] and last_user(body) != "ping":
            hung["left"] -= 1
            return Reply(steps=[chunk("", role="assistant"), chunk("a"), STALL])
        return echo(body)

    job = make_job(tmp_path, rows(4), conc=2, client="hang_timeout_s: 1.5, ")
    async with FakeServer(responder=replies) as server:
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (4, 0)
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    assert any("hung" in e for e in manifest["runs"][-1]["events"])
    ledger = [orjson.loads(x) for x in (tmp_path / "out" / "ledger.jsonl").read_bytes().split()]
    assert {e["attempts"] for e in ledger} == {1}  # the hang cost no retry


async def test_giving_up_on_servers_that_stay_down_keeps_work_pending(tmp_path: Path) -> None:
    job = make_job(tmp_path, rows(3), client="server_down_give_up_s: 1, ")
    async with FakeServer(responder=lambda b: Reply(status=503, body=b"down")) as server:
        summary = await run(job, server)
    assert summary.exit_code == 3
    assert summary.stopped is not None and "every server down" in summary.stopped
    assert (summary.done, summary.failed, summary.pending) == (0, 0, 3)


async def test_the_api_key_never_reaches_disk_or_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DG_KEY", SECRET)

    def replies(body: dict[str, Any]) -> Reply:
        q = last_user(body)
        if q == "question 0":  # a server that echoes the key back in its error
            return error_reply(400, f"bad key Bearer {SECRET} rejected")
        return echo(body)

    job = make_job(tmp_path, rows(3))
    job.write_text(job.read_text() + "api_key_env: DG_KEY\n")
    async with FakeServer(responder=replies) as server:
        summary = await run(job, server)
    assert server.seen[0].headers["Authorization"] == f"Bearer {SECRET}"
    assert (summary.done, summary.failed) == (2, 1)
    for p in (tmp_path / "out").rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err


async def test_api_key_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "key.txt").write_text(SECRET + "\n")
    job = make_job(tmp_path, rows(1))
    job.write_text(job.read_text() + "api_key_file: key.txt\n")
    async with FakeServer(responder=echo) as server:
        await run(job, server)
    assert server.seen[0].headers["Authorization"] == f"Bearer {SECRET}"


async def test_prompts_longer_than_the_servers_context_are_set_aside(tmp_path: Path) -> None:
    data = [*rows(3), {"id": 99, "messages": [{"role": "user", "content": "word " * 4000}]}]
    job = make_job(tmp_path, data)
    async with FakeServer(responder=echo, context_tokens=1000) as server:
        summary = await run(job, server)
    assert (summary.planned, summary.done) == (3, 3)
    # Never sent for an answer; counted at most (no /tokenize here: a one-token completion).
    assert all("word word" not in last_user(s.body) or s.body["max_tokens"] == 1
               for s in server.seen)
    rejected = [orjson.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_bytes()
                .splitlines()]
    assert len(rejected) == 1 and rejected[0]["reason"].startswith("prompt_too_long")
    assert rejected[0]["row"] == 4
    assert read_status(tmp_path / "out").rejected.too_long == 1  # named apart from bad rows


async def test_a_content_filter_stop_is_a_typed_failure(tmp_path: Path) -> None:
    def replies(body: dict[str, Any]) -> Reply:
        if last_user(body) == "question 0":
            return completion(["no"], finish="content_filter")
        return echo(body)

    job = make_job(tmp_path, rows(2))
    async with FakeServer(responder=replies) as server:
        await run(job, server)
    assert read_status(tmp_path / "out").failures == {"content_filter": 1}


async def test_a_write_error_stops_the_run_and_a_rerun_completes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftgen.store import shards

    real = shards.ShardWriter.append
    calls = {"n": 0}

    def full_after_two(self: shards.ShardWriter, lines: list[bytes]) -> Any:
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, lines)

    monkeypatch.setattr(shards.ShardWriter, "append", full_after_two)
    job = make_job(tmp_path, rows(20), conc=1)
    async with FakeServer(responder=echo) as server:
        with pytest.raises(DiskError, match="no space left"):
            await run(job, server)
        monkeypatch.setattr(shards.ShardWriter, "append", real)
        st = read_status(tmp_path / "out")
        assert 1 <= st.done < 20
        summary = await run(job, server)
    assert (summary.done, summary.failed) == (20, 0)
    ids = [orjson.loads(x)["id"] for p in sorted((tmp_path / "out" / "shards").glob("*"))
           for x in p.read_bytes().splitlines()]
    assert len(ids) == len(set(ids)) == 20


@pytest.mark.parametrize("status, body, says", [
    (401, b'{"error": "Incorrect API key provided: sk-ab***"}', "refused the API key"),
    (404, b'{"error": {"message": "The model `fake` does not exist."}}', "no such model"),
])
async def test_a_run_level_error_stops_the_run_and_charges_no_sample(
    tmp_path: Path, status: int, body: bytes, says: str
) -> None:
    job = make_job(tmp_path, rows(20), conc=2)
    async with FakeServer(responder=lambda _b: Reply(status=status, body=body)) as server:
        summary = await run(job, server)
        sent = len(server.seen)
    assert summary.exit_code == 1 and says in (summary.stopped or "")
    assert summary.failed == 0 and summary.done == 0 and summary.pending == 20
    assert sent <= 2  # the requests in flight when it was found, nothing after
    assert read_status(tmp_path / "out").failed == 0


def test_a_server_url_without_a_scheme_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from draftgen.cli import app

    job = make_job(tmp_path, rows(2))
    result = CliRunner().invoke(app, ["run", str(job), "--server", "localhost:8000"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: --server: 'localhost:8000' is not an http(s) URL (write http://localhost:8000)")


async def test_a_server_that_stops_listening_gets_its_silent_streams_back_within_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM to SGLang or vLLM closes the listener, then waits for open streams to end:
    draftgen closes them and requeues the samples uncharged, long before the hang
    watchdog would, and the progress shows the load poll failing, not its last reading."""
    monkeypatch.setattr(monitor, "GONE_SILENT_S", 0.3)
    streams: list[web.StreamResponse] = []
    closed: list[bool] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        streams.append(response)
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.05)
        closed.append(True)
        return response

    async def metrics(request: web.Request) -> web.Response:
        response = web.Response(text=f"vllm:num_requests_running {len(streams)}\n"
                                     "vllm:num_requests_waiting 0\n")
        # As uvicorn does once told to stop: no idle connection survives its listener.
        response.force_close()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    job = make_job(tmp_path, rows(3), client="hang_timeout_s: 120, server_down_give_up_s: 2, ")
    job.write_text(job.read_text() + "poll_interval_s: 0.1\n")
    try:
        task = asyncio.create_task(run_job(load_job(job), RunOptions(
            tmp_path / "out", servers=[url], progress=False)))
        while len(streams) < 3:
            await asyncio.sleep(0.02)
        started = time.monotonic()
        assert site._server is not None
        site._server.close()  # the listener only: open streams stay, silent
        summary = await asyncio.wait_for(task, timeout=30)
    finally:
        await runner.cleanup()
    assert time.monotonic() - started < 10  # the watchdog would wait 120 s
    assert len(closed) == 3  # draftgen hung up: the server is free to exit
    assert summary.exit_code == 3 and (summary.done, summary.failed, summary.pending) == (0, 0, 3)
    events = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())["runs"][-1]["events"]
    assert any("stopped listening" in e for e in events), events


def test_progress_shows_a_failing_load_poll_instead_of_its_last_reading() -> None:
    view = ServerSnapshot("http://a:1", True, 20, running=None, waiting=None,
                          load_error="Cannot connect to host a:1")
    text = server_text(view)
    assert "load poll failing (Cannot connect" in text and "running" not in text

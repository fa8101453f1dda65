"""What `run` adds around the loop: server verification, truncation policy, CLI commands."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_runner import echo, last_user, make_job, rows, run
from typer.testing import CliRunner

from draftgen.cli import app
from draftgen.errors import DraftgenError
from draftgen.export import ExportOptions, export_run
from draftgen.job import load_job
from draftgen.reporting.status import read_status
from draftgen.running.runner import RunOptions, run_job
from draftgen.servers import QualityPolicyError
from helpers.fakeserver import FakeServer, Reply, completion
from helpers.sglang_standin import StandinConfig, start_standin

REPO = Path(__file__).resolve().parents[3]


async def test_a_server_running_a_lossy_kv_cache_is_refused(tmp_path: Path) -> None:
    runner, url = await start_standin(StandinConfig(kv_cache_dtype="fp8_e4m3"))
    try:
        job = make_job(tmp_path, rows(2))
        with pytest.raises(QualityPolicyError, match="lossy KV cache"):
            await run_job(load_job(job), RunOptions(tmp_path / "out", servers=[url],
                                                    progress=False))
    finally:
        await runner.cleanup()


async def test_a_bf16_sglang_server_is_recorded_in_the_manifest(tmp_path: Path) -> None:
    runner, url = await start_standin(StandinConfig(kv_cache_dtype="bf16", dp_size=2))
    try:
        job = make_job(tmp_path, rows(2))
        summary = await run_job(load_job(job), RunOptions(tmp_path / "out", servers=[url],
                                                          progress=False))
    finally:
        await runner.cleanup()
    assert summary.done == 2
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    [server] = manifest["runs"][-1]["servers"]
    assert server["verified"] is True and server["engine"] == "sglang"
    assert server["kv_dtype"] == "bfloat16" and len(server["kv_tokens_per_rank"]) == 2
    assert server["version"] == "0.5.9"


async def test_an_unrecognised_server_is_used_but_recorded_as_unverified(tmp_path: Path) -> None:
    job = make_job(tmp_path, rows(1))
    async with FakeServer(responder=echo) as server:
        await run(job, server)
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    [record] = manifest["runs"][-1]["servers"]
    assert record["verified"] is False and record["url"] == server.url


ESCALATE = """
model: fake
partitions:
  short: {max_tokens: 8, concurrency: 4, truncation: escalate, escalate_to: long}
  long: {max_tokens: 64, concurrency: 2}
categories:
  - {name: chat, source: {path: chat.jsonl, id_field: id}, partition: short}
progress_interval_s: 1000
"""


async def test_truncated_samples_escalate_to_the_long_partition_on_request(
    tmp_path: Path,
) -> None:
    def replies(body: dict[str, Any]) -> Reply:
        long_answer = last_user(body) in ("question 0", "question 1")
        if long_answer and body["max_tokens"] < 64:
            return completion(["cut"], finish="length")
        return completion([f"answer ({body['max_tokens']})"])

    (tmp_path / "chat.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows(4)))
    job = tmp_path / "job.yaml"
    job.write_text(ESCALATE)
    async with FakeServer(responder=replies) as server:
        first = await run(job, server)
        assert (first.done, first.truncated) == (4, 2)
        again = await run(job, server)
        assert again.sent == 0  # escalation only when asked
        escalated = await run(job, server, rerun_truncated=True)
        assert escalated.sent == 2 and (escalated.done, escalated.truncated) == (4, 0)
        assert [s.body["max_tokens"] for s in server.seen[-2:]] == [64, 64]
        settled = await run(job, server)
        assert settled.sent == 0 and settled.done == 4
    s = export_run(tmp_path / "out", tmp_path / "x.jsonl", ExportOptions())
    assert (s.exported, s.truncated) == (4, 0)
    plan = [orjson.loads(x) for x in (tmp_path / "out" / "plan.jsonl").read_bytes().split()]
    assert sorted(p["partition"] for p in plan) == ["long", "long", "short", "short"]


async def test_truncation_keep_exports_truncated_samples_tagged(tmp_path: Path) -> None:
    job = make_job(tmp_path, rows(2))
    job.write_text(job.read_text().replace("concurrency: 4}", "concurrency: 4, truncation: keep}"))
    async with FakeServer(responder=lambda b: completion(["cut"], finish="length")) as server:
        await run(job, server)
    s = export_run(tmp_path / "out", tmp_path / "x.jsonl", ExportOptions())
    assert (s.exported, s.truncated) == (2, 0)
    rows_out = [orjson.loads(x) for x in (tmp_path / "x.jsonl").read_bytes().splitlines()]
    assert all(r["truncated"] is True for r in rows_out)
    assert read_status(tmp_path / "out").truncated == 2


def test_escalation_needs_a_larger_target_partition(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(ESCALATE.replace("max_tokens: 64", "max_tokens: 4"))
    result = CliRunner().invoke(app, ["plan", str(job)])
    assert result.exit_code == 2 and "escalate_to" in result.output


def test_serve_dry_run_prints_the_argv_and_refuses_a_lossy_profile(tmp_path: Path) -> None:
    profile = REPO / "examples" / "profiles" / "local-cpu.yaml"
    ok = CliRunner().invoke(app, ["serve", str(profile), "--dry-run"])
    assert ok.exit_code == 0, ok.output
    assert "vllm.entrypoints.openai.api_server" in ok.output
    assert "--kv-cache-dtype" in ok.output and "bfloat16" in ok.output
    lossy = tmp_path / "fp8.yaml"
    lossy.write_text(profile.read_text().replace("kv_cache_dtype: bfloat16",
                                                 "kv_cache_dtype: fp8"))
    refused = CliRunner().invoke(app, ["serve", str(lossy), "--dry-run"])
    assert refused.exit_code == 2
    assert "AIME" in refused.output and "mem_fraction" in refused.output
    assert "dp_attention" in refused.output


def test_plan_from_a_run_predicts_and_caps_to_a_budget(tmp_path: Path) -> None:
    job = make_job(tmp_path, rows(40), conc=4)

    async def record_a_run() -> None:
        async with FakeServer(responder=echo) as server:
            await run(job, server)

    asyncio.run(record_a_run())  # `plan` runs its own event loop: this test has none
    base = ["plan", str(job), "--from-run", str(tmp_path / "out"), "--kv-tokens", "100000"]
    full = CliRunner().invoke(app, base)
    assert full.exit_code == 0, full.output
    assert "predicted: 40 samples" in full.output
    tight = CliRunner().invoke(app, [*base, "--budget", "0.00005s", "--write-job",
                                     str(tmp_path / "capped.yaml")])
    assert tight.exit_code == 0, tight.output
    assert "caps to fit" in tight.output and "chat: 40 →" in tight.output
    capped = load_job(tmp_path / "capped.yaml")
    assert capped.categories[0].cap is not None and capped.categories[0].cap < 40
    assert capped.resolve(capped.categories[0].source.path or "").exists()
    no_measure = CliRunner().invoke(app, ["plan", str(job), "--budget", "48h"])
    assert no_measure.exit_code == 2 and "--from-run" in no_measure.output


def test_durations_parse() -> None:
    from draftgen.planning.forecast import parse_duration

    assert parse_duration("48h") == 172_800
    assert parse_duration("2d12h") == 216_000
    assert parse_duration("90m") == 5_400
    with pytest.raises(Exception, match="duration"):
        parse_duration("soon")


async def test_samples_of_a_rejected_configuration_are_regenerated_and_nothing_else(
    tmp_path: Path,
) -> None:
    """The Kimi case: a server ran a configuration someone later rejects. Every record names
    its server's configuration; `--redo-config ID` regenerates exactly those samples."""
    job = load_job(make_job(tmp_path, rows(4)))
    out = tmp_path / "out"

    async def run_on(cfg: StandinConfig, **opts: Any) -> Any:
        runner, url = await start_standin(cfg)
        try:
            return await run_job(job, RunOptions(out, servers=[url], progress=False, **opts))
        finally:
            await runner.cleanup()

    assert (await run_on(StandinConfig(version="0.5.9"))).done == 4
    [(old, n)] = read_status(out).configurations.items()
    assert n == 4
    described = read_status(out).configuration_lines()[0]
    assert old in described and "sglang 0.5.9" in described and "KV bfloat16" in described
    # An id no record has is a typo, not "nothing to do".
    with pytest.raises(DraftgenError, match="no configuration nope"):
        await run_on(StandinConfig(version="0.5.23"), redo_configs=("nope",))
    # The rejected configuration is still what this server runs: refused, nothing sent.
    with pytest.raises(DraftgenError, match="still runs configuration"):
        await run_on(StandinConfig(version="0.5.9"), redo_configs=(old,))
    # Another configuration: exactly the rejected samples are sent again.
    again = await run_on(StandinConfig(version="0.5.23"), redo_configs=(old,))
    assert again.sent == 4
    [(new, n)] = read_status(out).configurations.items()
    assert new != old and n == 4
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert {old, new} <= set(manifest["configurations"])
    # Nothing left under the rejected configuration: a rerun sends nothing.
    assert (await run_on(StandinConfig(version="0.5.23"), redo_configs=(old,))).sent == 0


async def test_a_server_back_from_an_outage_takes_no_request_before_it_is_verified(
    tmp_path: Path,
) -> None:
    """Down, then back with a lossy KV cache: the run stops (exit 2) before sending it a
    single sample; every record is from the configuration it was verified with."""
    cfg = StandinConfig(version="0.5.23", answer_tokens=4, token_delay_s=0.005)
    runner, url = await start_standin(cfg)
    out = tmp_path / "out"
    try:
        job = load_job(make_job(tmp_path, rows(60)))
        run_task = asyncio.create_task(run_job(job, RunOptions(out, servers=[url],
                                                               progress=False)))
        while not (out / "plan.jsonl").exists() or read_status(out).done < 3:
            await asyncio.sleep(0.02)
        cfg.starting_polls = 10**9  # every generating request 503s: the server is down
        await asyncio.sleep(0.3)
        cfg.kv_cache_dtype = "fp8_e4m3"  # ...and comes back with a lossy KV cache
        cfg.starting_polls = 0
        summary = await asyncio.wait_for(run_task, timeout=60)
    finally:
        await runner.cleanup()
    assert summary.exit_code == 2 and "quality policy" in (summary.stopped or "")
    st = read_status(out)
    [(verified, n)] = st.configurations.items()
    assert n == st.done and st.done < 60
    assert st.manifest["configurations"][verified]["kv_dtype"] == "bfloat16"


async def test_export_keeps_source_ids_and_source_order_when_asked(tmp_path: Path) -> None:
    data = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
            for i in range(8)]
    job = make_job(tmp_path, data)
    async with FakeServer(responder=echo) as server:
        await run(job, server)
    out = tmp_path / "out"

    def exported(**kw: Any) -> list[str]:
        export_run(out, tmp_path / "x.jsonl", ExportOptions(**kw))
        return [orjson.loads(r)["id"] for r in (tmp_path / "x.jsonl").read_bytes().splitlines()]

    plan_order = exported()
    assert sorted(plan_order) == sorted(f"chat-{r['id']}" for r in data)
    assert plan_order != sorted(plan_order, key=lambda i: int(i.split("q")[-1]))  # shuffled
    source = exported(ids="source", order="source")
    assert source == [f"q{i}" for i in range(8)]  # source order, the source's own ids


def test_a_source_id_that_would_name_two_rows_keeps_draftgens() -> None:
    from draftgen.export.writing import _export_ids

    plan = [{"id": "a-1", "source_id": "x"}, {"id": "x"},  # "x" is already a row's id
            {"id": "a-2", "source_id": "d"}, {"id": "b-2", "source_id": "d"},  # shared
            {"id": "a-3", "source_id": "e"}]
    assert _export_ids(plan, "source") == {"a-3": "e"}
    assert _export_ids(plan, "draftgen") == {}


async def test_a_server_behind_an_api_key_is_verified_and_polled_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiohttp import web

    from helpers.sglang_standin import make_app

    key = "sk-standin-key-0123456789"
    refused: list[str] = []

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        # SGLang with --api-key guards every route, /server_info and /metrics included.
        if request.headers.get("Authorization") != f"Bearer {key}":
            refused.append(request.path)
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    app = make_app(StandinConfig(version="0.5.23", enable_metrics=True))
    app.middlewares.append(guard)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    monkeypatch.setenv("STANDIN_KEY", key)
    job = make_job(tmp_path, rows(3))
    job.write_text(job.read_text() + "api_key_env: STANDIN_KEY\n")
    try:
        summary = await run_job(load_job(job), RunOptions(tmp_path / "out", servers=[url],
                                                          progress=False))
    finally:
        await runner.cleanup()
    assert summary.done == 3 and refused == []
    manifest = orjson.loads((tmp_path / "out" / "manifest.json").read_bytes())
    [server] = manifest["runs"][-1]["servers"]
    assert server["verified"] is True and server["kv_dtype"] == "bfloat16"
    assert key.encode() not in (tmp_path / "out" / "manifest.json").read_bytes()


async def test_a_server_down_at_its_first_check_is_not_back_with_other_settings(
    tmp_path: Path,
) -> None:
    """Unreachable when first checked, then answering: that is its first configuration, not
    a change — and the record names it."""
    from aiohttp import web

    from draftgen.running.attach import AttachedServers
    from draftgen.servers.process import find_free_port
    from helpers.sglang_standin import make_app

    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    servers = AttachedServers(load_job(make_job(tmp_path, rows(1))), [url], tmp_path,
                              log=lambda _m: None)
    first = await servers.verify(url)
    assert first is not None and first["verified"] is False
    runner = web.AppRunner(make_app(StandinConfig(version="0.5.23")))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        second = await servers.verify(url)
    finally:
        await runner.cleanup()
    assert second is not None and second["verified"] is True
    assert second["changed_mid_run"] is False
    assert servers.configuration_of(url) in servers.configurations


def test_the_progress_shows_servers_as_they_are_now_not_at_the_last_poll() -> None:
    from draftgen.clock import REAL_CLOCK
    from draftgen.running.stats import RunStats, ServerSnapshot

    stats = RunStats(REAL_CLOCK)
    live = {"in_flight": 29}
    stats.server_view = lambda: (ServerSnapshot("http://a", True, live["in_flight"]),)
    assert stats.snapshot().servers[0].in_flight == 29
    live["in_flight"] = 0  # the run ended: the last line must not say 29 in flight
    assert stats.snapshot().servers[0].in_flight == 0

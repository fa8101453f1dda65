"""`draftgen serve GATEWAY_PROFILE` and a run's launched gateways (gateways/launch.py)
against stand-ins launched as real processes: each worker is the SGLang stand-in run with
SGLang's own argv (as in test_server_launcher.py), the gateway the smg stand-in
(helpers/smg_standin.py), run with the argv draftgen gives smg. The real two-vLLM lifecycle
is the example job's in tests/integration/test_gateway.py.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import stat
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.cli.serve import serve
from draftgen.gateways.launch import read_gateway, stop_gateway
from draftgen.gateways.profile import load_gateway_profile
from draftgen.job import load_job
from draftgen.running.attach import AttachedServers
from draftgen.servers.launcher import read_handle, running, stop
from draftgen.servers.process import group_alive

TESTS = Path(__file__).resolve().parents[2]
EXAMPLE = TESTS.parent / "examples" / "profiles" / "local-cpu-gateway.yaml"

pytestmark = pytest.mark.timeout(120)


def script(path: Path, module: str) -> str:
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                    f"from helpers.{module} import main\nmain(sys.argv[1:])\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def write_gateway(tmp_path: Path) -> Iterator[Any]:
    """Writes gw.yaml (workers a and b, the stand-ins) and returns its path; whatever a test
    started is stopped after it."""
    fake_python = script(tmp_path / "fake-python", "sglang_standin")
    fake_smg = script(tmp_path / "fake-smg", "smg_standin")

    def write(a: dict[str, Any] | None = None, b: dict[str, Any] | None = None,
              **settings: Any) -> Path:
        for name, fields in (("a", a), ("b", b)):
            data = {"engine": "sglang", "model_path": "/models/Kimi-K2.5", "served_name": "kimi",
                    "name": name, "tp": 8, "port": 0, "python": fake_python,
                    "mem_fraction": 0.8, **(fields or {})}
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump({
            "name": "gw", "state_dir": str(tmp_path / "state"),
            "gateway": {"workers": ["a.yaml", "b.yaml"], "port": 0, "python": fake_smg,
                        **settings}}))
        return path

    yield write
    stop_gateway(tmp_path / "state" / "gw", timeout_s=2)
    for name in ("a", "b"):
        stop(tmp_path / "state" / "gw" / "workers" / name, timeout_s=2)


def listed(gateway_url: str) -> list[str]:
    with urllib.request.urlopen(gateway_url + "/workers", timeout=5) as r:
        return [w["url"] for w in json.load(r)["workers"]]


def test_dry_run_prints_both_workers_and_the_gateway_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRAFTGEN_SERVERS_DIR", str(tmp_path / "servers"))
    assert serve(EXAMPLE, dry_run=True) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(commands) == 3
    worker0, worker1, smg = (shlex.split(c) for c in commands)
    assert worker0[worker0.index("--port") + 1] == "8001"
    assert worker1[worker1.index("--port") + 1] == "8002"
    assert "# env VLLM_CPU_OMP_THREADS_BIND=0" in out and "# env VLLM_CPU_OMP_THREADS_BIND=1" in out
    assert smg[1:4] == ["-m", "smg", "launch"]
    assert smg[smg.index("--port") + 1] == "30000"
    assert smg[smg.index("--worker-urls") + 1:] == ["http://127.0.0.1:8001",
                                                     "http://127.0.0.1:8002"]
    assert "--policy manual --disable-worker-overload-protection" in commands[2]
    assert "# --prometheus-port 0: a free port is chosen at start" in out
    folder = tmp_path / "servers" / "local-cpu-gateway"
    assert f"state, log and pid under {folder / 'workers' / 'local-cpu-worker-0'}" in out
    assert f"state, log and pid under {folder}\n" in out
    assert not (tmp_path / "servers").exists()


def test_serve_starts_reports_again_restarts_and_stops_everything(
    write_gateway: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_gateway()
    assert serve(path, timeout_s=60) == 0
    out = capsys.readouterr().out
    record = read_gateway(tmp_path / "state" / "gw")
    assert record is not None
    assert out.startswith(f"gateway up at {record.url} — 2 workers, pid {record.pid}\n")
    assert out.count("up — 160,000 KV tokens, bf16 KV") == 2
    assert "a: up — " in out and "b: up — " in out
    workers = [read_handle(folder) for folder in record.workers]
    assert [w.name for w in workers if w is not None] == ["a", "b"]
    assert sorted(listed(record.url)) == sorted(w.url for w in workers if w is not None)
    state = json.loads((record.dir / "state.json").read_text())
    assert state["status"] == "up" and state["profile_file"] == str(path)
    assert (record.dir / "gateway.pid").read_text().strip() == str(record.pid)

    # Again, same profile: reported, not restarted.
    assert serve(path, timeout_s=60) == 0
    assert "(already running)" in capsys.readouterr().out
    assert read_gateway(record.dir) == record
    # A worker's settings changed: refused without --restart, applied with it.
    changed = write_gateway(b={"mem_fraction": 0.85})
    assert serve(changed, timeout_s=60) == 1
    assert "with other settings; use --restart" in capsys.readouterr().err
    assert serve(changed, restart=True, timeout_s=60) == 0
    out = capsys.readouterr().out
    assert "b: KV tokens: 160,000 → 170,000" in out
    assert "a: no change in capacity or settings" in out
    again = read_gateway(record.dir)
    assert again is not None and again.pid != record.pid
    # Port 0 keeps the address it had: a job naming the gateway still finds it.
    assert (again.url, again.metrics_port) == (record.url, record.metrics_port)
    assert [read_handle(f).port for f in again.workers] == [w.port for w in workers if w]

    # --stop by the state directory: the gateway and both workers.
    monkeypatch.setenv("DRAFTGEN_SERVERS_DIR", str(tmp_path / "state"))
    assert serve(None, stop=True) == 0
    assert capsys.readouterr().out == (
        f"stopped gw: the gateway (pid {again.pid}, {again.url}) and 2 workers\n")
    assert not group_alive(again.pid)
    assert all(running(f) is None for f in again.workers)
    assert json.loads((record.dir / "state.json").read_text())["status"] == "stopped"
    assert serve(path, stop=True) == 0
    assert "no server running" in capsys.readouterr().out


def test_a_worker_that_fails_stops_the_other_and_no_gateway_starts(
    write_gateway: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # a keeps answering 503 (still loading) until it is cancelled; b crashes at once.
    path = write_gateway(a={"env": {"STANDIN_STARTING_POLLS": "100000"}},
                         b={"env": {"STANDIN_MODE": "crash"}})
    assert serve(path, timeout_s=60) == 1
    err = capsys.readouterr().err
    assert "worker b: sglang exited (code 3) while starting" in err.splitlines()
    folder = tmp_path / "state" / "gw"
    assert read_gateway(folder) is None
    a = read_handle(folder / "workers" / "a")
    assert a is not None and not group_alive(a.pid)
    assert json.loads((folder / "workers" / "a" / "state.json").read_text())["status"] == (
        "stopped")


def test_a_gateway_that_fails_stops_the_workers(
    write_gateway: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SMG_STANDIN_MODE", "crash")
    assert serve(write_gateway(), timeout_s=60) == 1
    assert any(line.startswith("the gateway exited (1)")
               for line in capsys.readouterr().err.splitlines())
    folder = tmp_path / "state" / "gw"
    assert "told to fail" in (folder / "gateway.log").read_text()
    for name in ("a", "b"):
        handle = read_handle(folder / "workers" / name)
        assert handle is not None and not group_alive(handle.pid)


@pytest.mark.parametrize("entry", ["{launch: gw.yaml}", "{workers: [a.yaml, b.yaml]}"])
def test_a_run_launches_a_gateway_profile_or_workers_entry_and_stops_it(
    write_gateway: Any, tmp_path: Path, entry: str
) -> None:
    write_gateway(a={"max_running_requests": 24})
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "job.yaml").write_text(
        f"model: kimi\nservers: [{entry}]\npartitions: {{s: {{max_tokens: 8}}}}\n"
        "categories: [{name: c, source: {path: p.jsonl}, partition: s}]\noutput: out\n")
    state_dir = tmp_path / "out" / "servers"
    logged: list[str] = []

    async def go() -> tuple[str, list[str], dict[str, int]]:
        async with AttachedServers(load_job(tmp_path / "job.yaml"), [], state_dir,
                                   log=logged.append) as servers:
            [url] = servers.gateways
            return url, listed(url), servers.launched_limits

    url, workers, limits = asyncio.run(go())
    # The running limit worker a was launched with, under the URL the gateway lists it by
    # (the scheduler's key); b was launched with none.
    assert list(limits.values()) == [24] and set(limits) < set(workers), (limits, workers)
    name = "gw" if "launch" in entry else "gateway"
    record = read_gateway(state_dir / name)
    assert record is not None and record.url == url and len(workers) == 2
    # Free ports, state under the run: never the profile's own folder or ports.
    assert [f.parent for f in record.workers] == [state_dir / name / "workers"] * 2
    assert sum("launching sglang" in line for line in logged) == 2
    assert not group_alive(record.pid)
    assert all(running(f) is None for f in record.workers)
    assert not (tmp_path / "state").exists()
    assert load_gateway_profile(tmp_path / "gw.yaml").state_path == tmp_path / "state" / "gw"

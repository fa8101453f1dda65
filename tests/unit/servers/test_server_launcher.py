"""The launcher's lifecycle against the SGLang stand-in launched as a real process.

The profile's `python` is a script that runs the stand-in, so the server gets SGLang's own
argv and answers like SGLang, and forks a child so that stopping the process group can be
checked. The real vLLM lifecycle is tests/integration/test_serve.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.cli.serve import serve
from draftgen.servers import (
    LaunchError,
    QualityPolicyError,
    launch,
    load_profile,
    restart,
    running,
    start,
    stop,
    wait_ready,
)
from draftgen.servers import launcher as launcher_module
from draftgen.servers.process import group_alive, pid_alive

TESTS = Path(__file__).resolve().parents[2]  # where the helpers package lives


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake-python"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from helpers.sglang_standin import main\nmain(sys.argv[1:])\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.fixture
def write_profile(tmp_path: Path, fake_python: str) -> Iterator[Any]:
    paths: list[Path] = []

    def write(**fields: Any) -> Path:
        data = {"engine": "sglang", "model_path": "/models/Kimi-K2.5", "served_name": "kimi",
                "name": "kimi", "tp": 8, "port": 0, "python": fake_python,
                "state_dir": str(tmp_path / "state"), "mem_fraction": 0.8, **fields}
        path = tmp_path / f"{data['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        paths.append(path)
        return path

    yield write
    # Never leave a stand-in behind, whatever a test did.
    for path in set(paths):
        stop(load_profile(path), timeout_s=2)


def state(profile_path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (load_profile(profile_path).state_path / "state.json").read_text()
    )
    return data


def test_launch_verify_and_stop_leave_files_and_no_process(
    write_profile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_CHILD", "1")
    monkeypatch.setenv("STANDIN_STARTING_POLLS", "2")
    profile = load_profile(write_profile(dp=2, dp_attention=True, max_running_requests=256))
    waits: list[float] = []
    verified = launch(profile, timeout_s=60, on_wait=waits.append)
    handle = verified.handle
    # The stand-in answers 503 twice before its first generation: the wait saw it.
    assert waits
    assert verified.info.kv_tokens_per_rank == (160_000, 160_000)
    assert verified.summary == "up — 320,000 KV tokens (2 ranks × 160,000), bf16 KV"
    assert verified.quality_stamp is None
    # A group of its own, in our session.
    assert os.getpgid(handle.pid) == handle.pid
    assert os.getsid(handle.pid) == os.getsid(0)
    folder = profile.state_path
    assert (folder / "server.pid").read_text().strip() == str(handle.pid)
    assert state(profile.source_file or Path())["status"] == "up"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["summary"] == verified.summary
    assert summary["info"]["kv_tokens"] == 320_000
    assert summary["gpus"] is None
    log = (folder / "server.log").read_text()
    assert "--kv-cache-dtype bf16" in log and "child pid:" in log
    # The probe found SGLang 0.5.23, which has --attn-dp-size: not the deprecated spelling.
    assert "--attn-dp-size 2" in log and "--enable-dp-attention" not in log
    assert (verified.info.version, verified.info.dp, verified.info.attn_dp) == ("0.5.23", 1, 2)
    assert running(profile) == handle

    assert stop(profile) is True
    assert not group_alive(handle.pid)
    assert not (folder / "server.pid").exists()
    assert running(profile) is None
    assert stop(profile) is False


def test_an_older_sglang_gets_the_dp_attention_flags_it_knows(
    write_profile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0.5.9 has no --attn-dp-size and refuses it as an unrecognized argument.
    monkeypatch.setenv("STANDIN_VERSION", "0.5.9")
    profile = load_profile(write_profile(dp=2, dp_attention=True))
    verified = launch(profile, timeout_s=60)
    log = (profile.state_path / "server.log").read_text()
    assert "--dp-size 2 --enable-dp-attention" in log and "--attn-dp-size" not in log
    assert (verified.info.version, verified.info.dp, verified.info.attn_dp) == ("0.5.9", 2, None)
    assert verified.info.kv_tokens_per_rank == (160_000, 160_000)


def test_a_flag_the_installed_sglang_does_not_know_fails_the_launch(
    write_profile: Any,
) -> None:
    profile = load_profile(write_profile(extra_args=["--no-such-flag", "1"]))
    with pytest.raises(LaunchError, match=r"exited \(code 2\) while starting") as excinfo:
        launch(profile, timeout_s=60)
    assert "unrecognized arguments: --no-such-flag 1" in str(excinfo.value)
    assert running(profile) is None


def test_restart_keeps_the_port_and_reports_the_capacity_change(write_profile: Any) -> None:
    first = launch(load_profile(write_profile(mem_fraction=0.8)), timeout_s=60)
    profile = load_profile(write_profile(mem_fraction=0.9))
    before, after = restart(profile, timeout_s=60)
    assert before is not None and before.kv_tokens == 160_000
    assert after.info.kv_tokens == 180_000
    assert after.handle.port == first.handle.port
    assert after.handle.pid != first.handle.pid
    assert not group_alive(first.handle.pid)
    assert after.info.mem_fraction == 0.9


def test_starting_twice_is_refused_and_a_busy_port_too(write_profile: Any) -> None:
    profile = load_profile(write_profile())
    launch(profile, timeout_s=60)
    with pytest.raises(LaunchError, match="already running"):
        start(profile)
    stop(profile)
    busy = launch(profile, timeout_s=60).handle.port
    other = load_profile(write_profile(name="other", port=busy))
    with pytest.raises(LaunchError, match=f"port {busy} is already in use"):
        start(other)


def test_a_crash_while_starting_raises_with_the_log_tail(
    write_profile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "crash")
    profile = load_profile(write_profile())
    with pytest.raises(LaunchError, match=r"exited \(code 3\) while starting") as excinfo:
        launch(profile, timeout_s=60)
    assert "CUDA is not available" in str(excinfo.value)
    assert running(profile) is None
    assert state(profile.source_file or Path())["status"] == "stopped"


def test_a_server_that_never_answers_times_out_and_is_stopped(
    write_profile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "silent")
    monkeypatch.setenv("STANDIN_CHILD", "1")
    profile = load_profile(write_profile())
    handle = start(profile)
    ticks = iter(range(100))
    with pytest.raises(LaunchError, match="did not answer a chat completion within 3 s"):
        wait_ready(handle, timeout_s=3, poll_s=0, monotonic=lambda: float(next(ticks)),
                   sleep=lambda _s: None)
    assert running(profile) == handle  # wait_ready leaves the decision to its caller
    assert stop(profile)
    assert not group_alive(handle.pid)


def test_stop_escalates_to_sigkill_and_works_from_another_process(
    write_profile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "ignore-term")
    monkeypatch.setenv("STANDIN_CHILD", "1")
    profile = load_profile(write_profile())
    handle = launch(profile, timeout_s=60).handle
    # As `draftgen serve --stop` in a new process sees it: no child object, only the files.
    child = launcher_module._children.pop(handle.pid)
    assert stop(profile, timeout_s=0.5) is True
    child.wait(5)  # reap it here, as init would for a detached server
    assert not group_alive(handle.pid)
    assert not pid_alive(handle.pid)


def test_the_policy_runs_before_any_process_starts(write_profile: Any) -> None:
    profile = load_profile(write_profile(kv_cache_dtype="fp8_e4m3"))
    with pytest.raises(QualityPolicyError):
        start(profile)
    assert not profile.state_path.exists()


def test_a_server_found_running_a_lossy_cache_is_stopped(
    write_profile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Asked for bf16, the server runs fp8 anyway: only the after-start check can see it.
    monkeypatch.setenv("STANDIN_KV_DTYPE", "fp8_e4m3")
    profile = load_profile(write_profile())
    with pytest.raises(QualityPolicyError, match=r"policy violation.*fp8_e4m3"):
        launch(profile, timeout_s=60)
    assert running(profile) is None


def test_serve_command_start_again_restart_and_stop(
    write_profile: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_profile()
    assert serve(path, timeout_s=60) == 0
    out = capsys.readouterr().out
    assert out.startswith("up — 160,000 KV tokens, bf16 KV\n")
    assert "sglang 0.5.23 at http://127.0.0.1:" in out
    # Same profile again: reported, not restarted.
    assert serve(path, timeout_s=60) == 0
    assert "(already running)" in capsys.readouterr().out
    # Other settings while it runs: refused without --restart.
    changed = write_profile(mem_fraction=0.85)
    assert serve(changed, timeout_s=60) == 1
    assert "use --restart" in capsys.readouterr().err
    assert serve(changed, restart=True, timeout_s=60) == 0
    out = capsys.readouterr().out
    assert "KV tokens: 160,000 → 170,000 (+10,000, ×1.06)" in out
    assert "memory fraction: 0.8 → 0.85" in out
    # --stop with the state directory (no profile needed), then with nothing to stop.
    monkeypatch.setenv("DRAFTGEN_SERVERS_DIR", str(load_profile(changed).state_path.parent))
    assert serve(None, stop=True) == 0
    assert capsys.readouterr().out.startswith("stopped kimi (pid ")
    assert serve(None, stop=True) == 0
    assert "no server running" in capsys.readouterr().out

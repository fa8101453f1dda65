"""LocalEngine's process handling, with a small stand-in server instead of vLLM.

The stand-in is launched exactly as vLLM would be (it takes LocalEngine's argv as its
interpreter's arguments), answers the one-token readiness request, and forks a child so
that stopping the whole process group can be checked. The real engine is covered in
tests/integration/test_engine.py.
"""

from __future__ import annotations

import os
import stat
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from draftgen.local import EngineError, LocalEngine, find_free_port

FAKE_SERVER = """\
import http.server, os, signal, subprocess, sys, time

mode = os.environ.get("FAKE_ENGINE_MODE", "serve")
print("fake engine argv:", " ".join(sys.argv[1:]), flush=True)
print("kv space:", os.environ.get("VLLM_CPU_KVCACHE_SPACE"), flush=True)
if mode == "crash":
    print("ValueError: cannot load model from /nowhere", flush=True)
    sys.exit(3)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# A child in the same process group, like vLLM's engine core.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child pid:", child.pid, flush=True)
if mode == "silent":
    time.sleep(600)
port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(http.server.BaseHTTPRequestHandler):
    def _reply(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b'{"choices": [{"index": 0, "message": {"content": "x"}}]}')

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def get(url: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        status: int = response.status
    return status


def test_argv_is_the_documented_vllm_command(tmp_path: Path) -> None:
    engine = LocalEngine(
        tmp_path / "model",
        port=8123,
        max_model_len=1024,
        num_gpu_blocks_override=16,
        served_name="m",
        python="/venv/bin/python",
        extra_args=["--max-num-seqs", "8"],
    )
    argv = engine.argv()
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv[3:])
    for expected in [
        f"--model {tmp_path / 'model'}",
        "--served-model-name m",
        "--host 127.0.0.1",
        "--port 8123",
        "--dtype bfloat16",
        "--max-model-len 1024",
        "--enforce-eager",
        "--num-gpu-blocks-override 16",
    ]:
        assert expected in flags
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert engine.url == "http://127.0.0.1:8123"
    assert "--num-gpu-blocks-override" not in LocalEngine(tmp_path).argv()


def test_env_sets_kv_space_and_offline_mode(tmp_path: Path) -> None:
    env = LocalEngine(tmp_path, kv_cache_gib=3).env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    pinned = LocalEngine(tmp_path, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"}).env()
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    with pytest.raises(ValueError):
        LocalEngine(tmp_path, kv_cache_gib=0)


def test_port_zero_picks_a_free_port(tmp_path: Path) -> None:
    engine = LocalEngine(tmp_path)
    assert engine.port > 0
    assert engine.url == f"http://127.0.0.1:{engine.port}"
    assert find_free_port() > 0


def test_start_waits_for_an_answer_and_stop_ends_the_group(
    fake_python: str, tmp_path: Path
) -> None:
    log = tmp_path / "engine.log"
    engine = LocalEngine(tmp_path, python=fake_python, log_path=log, kv_cache_gib=2)
    with engine:
        pgid = engine.pid
        assert pgid is not None
        assert get(f"{engine.url}/health", 5) == 200
        # The server leads its own process group inside our session (not setsid).
        assert os.getpgid(pgid) == pgid
        assert os.getsid(pgid) == os.getsid(0)
    assert engine.pid is None
    assert not group_alive(pgid)
    text = log.read_text()
    assert "--enforce-eager" in text
    assert "kv space: 2" in text


def test_stop_escalates_to_sigkill(
    fake_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ignore-term")
    engine = LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log")
    engine.start(timeout_s=30)
    pgid = engine.pid
    assert pgid is not None
    engine.stop(timeout_s=0.5)
    assert not group_alive(pgid)


def test_suspend_freezes_and_resume_thaws(fake_python: str, tmp_path: Path) -> None:
    with LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log") as engine:
        engine.suspend()
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            get(f"{engine.url}/health", 0.5)
        engine.resume()
        assert get(f"{engine.url}/health", 5) == 200


def test_stop_ends_a_suspended_engine(fake_python: str, tmp_path: Path) -> None:
    engine = LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log")
    engine.start(timeout_s=30)
    pgid = engine.pid
    assert pgid is not None
    engine.suspend()
    engine.stop(timeout_s=5)
    assert not group_alive(pgid)


def test_kill_ends_the_group_at_once(fake_python: str, tmp_path: Path) -> None:
    engine = LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log")
    engine.start(timeout_s=30)
    pgid = engine.pid
    assert pgid is not None
    engine.kill()
    assert engine.pid is None
    assert not group_alive(pgid)
    engine.stop()  # stopping a dead engine is a no-op


def test_a_crash_while_starting_raises_with_the_log_tail(
    fake_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash")
    engine = LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log")
    with pytest.raises(EngineError, match="exited with code 3") as excinfo:
        engine.start(timeout_s=30)
    assert "cannot load model from /nowhere" in str(excinfo.value)
    assert engine.pid is None


def test_a_start_timeout_stops_the_engine(
    fake_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_MODE", "silent")
    engine = LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log")
    with pytest.raises(EngineError, match="did not answer") as excinfo:
        engine.start(timeout_s=1)
    assert "child pid:" in str(excinfo.value)
    assert engine.pid is None


def test_starting_twice_is_refused(fake_python: str, tmp_path: Path) -> None:
    with (
        LocalEngine(tmp_path, python=fake_python, log_path=tmp_path / "log") as engine,
        pytest.raises(EngineError, match="already running"),
    ):
        engine.start()

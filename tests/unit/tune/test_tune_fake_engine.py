"""A whole tune against a fake vLLM launched as a real process (`fake_vllm.py`): the API key
planted everywhere a user can put one never reaches a file, an error or a log; a server
launched with a key gets it, and one that refuses the key sent stops the tune at once; a
window whose requests fail fails its candidate; a changed tune section or engine release
gets a tune directory of its own."""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.engines.install import detect_install
from draftgen.errors import JobError
from draftgen.job import JobSpec, load_job
from draftgen.servers import LaunchError, launch, load_profile, stop
from draftgen.tune import TuneOptions, TuneResult, format_table, tune

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
JOB_KEY = "sk-planted-job-key-7f3a9c"
ENV_SECRET = "hf-planted-token-51be02"
WRONG_KEY = "sk-wrong-key-0d2e"
PROMPTS = ["hello there", "what is 2+2", "tell me a story", "name a color", "say hi",
           "count to three"]


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      f"sys.path[:0] = [{str(TESTS)!r}, {str(HERE)!r}]\n"
                      "from fake_vllm import main\nmain(sys.argv[1:])\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.fixture
def write_profile(tmp_path: Path, fake_python: str) -> Iterator[Any]:
    written: list[Path] = []

    def write(**fields: Any) -> Path:
        (tmp_path / "model").mkdir(exist_ok=True)
        data = {"engine": "vllm", "name": "fake", "model_path": str(tmp_path / "model"),
                "served_name": "fake", "python": fake_python, "port": 0,
                "kv_cache_dtype": "bfloat16", "max_running_requests": 1,
                "state_dir": str(tmp_path / "servers"),
                "tune": {"candidates": [{"max_running_requests": 4}]}, **fields}
        path = tmp_path / "profile.yaml"
        path.write_text(yaml.safe_dump(data))
        written.append(path)
        return path

    yield write
    for path in written:
        stop(load_profile(path), timeout_s=2)


def write_job(tmp_path: Path, key_in: str = "env") -> JobSpec:
    (tmp_path / "prompts.jsonl").write_text(
        "".join(f'{{"prompt": "{p}"}}\n' for p in PROMPTS))
    source = ({"api_key_env": "FAKE_JOB_KEY"} if key_in == "env" else
              {"api_key_file": "key.txt"} if key_in == "file" else {})
    (tmp_path / "key.txt").write_text(JOB_KEY + "\n")
    job = {"model": "fake", "servers": [{"url": "http://127.0.0.1:9"}], **source,
           "partitions": {"short": {"max_tokens": 12, "concurrency": 4}},
           "categories": [{"name": "chat", "partition": "short",
                           "source": {"path": "prompts.jsonl", "layout": "prompt"}}],
           "output": "out"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return load_job(path)


def options(tmp_path: Path, events: list[str], **kw: Any) -> TuneOptions:
    return TuneOptions(**{"budget_s": 300, "tune_dir": tmp_path / "tune", "measure_s": 0.6,
                          "warmup_s": 0.2, "max_rungs": 1, "probe_n": 2,
                          "probe_max_tokens": 4, "launch_timeout_s": 30,
                          "on_event": events.append, **kw})


def files_with(root: Path, *secrets: str) -> list[str]:
    """Every file under `root` that holds one of `secrets`, as `path: secret`."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path}: {s}" for s in secrets if s.encode() in data]
    return found


@pytest.mark.parametrize("where", ["argv", "env"])
async def test_a_key_planted_everywhere_reaches_no_file_error_or_log(
        where: str, tmp_path: Path, write_profile: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's key on its command line or in its environment, the same key as the job's
    # (in an environment variable or a file), and another secret in the profile's env.
    monkeypatch.setenv("FAKE_JOB_KEY", JOB_KEY)
    env = {"HF_TOKEN": ENV_SECRET, "OTHER_SETTING": "plain"}
    if where == "argv":
        profile = write_profile(extra_args=["--api-key", JOB_KEY], env=env)
    else:
        profile = write_profile(env={**env, "VLLM_API_KEY": JOB_KEY})
    job = write_job(tmp_path, "env" if where == "argv" else "file")
    events: list[str] = []
    result = await tune(profile, job, options(tmp_path, events,
                                              write=tmp_path / "best" / "tuned.yaml"))
    table = format_table(result)
    # The key was sent wherever the tune talked to its servers: everything measured.
    assert result.ok, table
    assert {r.status for r in result.rows} == {"measured"}, table
    assert files_with(tmp_path / "tune", JOB_KEY, ENV_SECRET) == []
    assert files_with(tmp_path / "best", JOB_KEY, ENV_SECRET) == []
    assert files_with(tmp_path / "servers", JOB_KEY, ENV_SECRET) == []
    for text in [table, *events]:
        assert JOB_KEY not in text and ENV_SECRET not in text, text
    # The profile written says where the secrets were left out, and launches nothing with
    # a key of ours: put back, it is the reference's.
    best = (tmp_path / "best" / "tuned.yaml").read_text()
    assert "REDACTED" in best and "secret" in best.lower()
    assert "plain" in best


async def test_the_log_and_errors_quote_no_key(
        tmp_path: Path, write_profile: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The job's key is not the server's: the server's 401 quotes the header it was sent.
    monkeypatch.setenv("FAKE_JOB_KEY", WRONG_KEY)
    profile = write_profile(extra_args=["--api-key", JOB_KEY], env={"HF_TOKEN": ENV_SECRET})
    job = write_job(tmp_path)
    events: list[str] = []
    started = time.monotonic()
    with pytest.raises(JobError) as caught:
        await tune(profile, job, options(tmp_path, events))
    # At once, not after the launch timeout, and saying what is wrong.
    assert time.monotonic() - started < 20
    message = str(caught.value)
    assert "API key" in message and "401" in message, message
    for text in [message, *events]:
        assert all(s not in text for s in (JOB_KEY, WRONG_KEY, ENV_SECRET)), text
    # Only where the user put them.
    assert set(files_with(tmp_path, JOB_KEY, WRONG_KEY, ENV_SECRET)) == {
        f"{tmp_path / 'profile.yaml'}: {JOB_KEY}", f"{tmp_path / 'profile.yaml'}: {ENV_SECRET}",
        f"{tmp_path / 'key.txt'}: {JOB_KEY}"}


def test_readiness_sends_the_launch_key_and_stops_at_a_refused_one(
        write_profile: Any) -> None:
    profile = load_profile(write_profile(extra_args=["--api-key", JOB_KEY]))
    # `serve`: no job, the profile's own key.
    verified = launch(profile, timeout_s=30)
    assert verified.info.kv_tokens == 65536
    stop(profile)
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(profile, timeout_s=60, api_key="sk-another-key")
    assert time.monotonic() - started < 20
    assert "refused the API key" in str(caught.value) and "HTTP 401" in str(caught.value)
    assert JOB_KEY not in str(caught.value) and "sk-another-key" not in str(caught.value)
    assert not os.path.exists(profile.state_path / "server.pid")


async def test_failed_requests_in_the_window_fail_the_candidate(
        tmp_path: Path, write_profile: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Launched with --max-num-seqs 4 (the candidate), every third request fails.
    monkeypatch.setenv("FAKE_FAIL", "4:3")
    profile = write_profile()
    job = write_job(tmp_path, "none")
    result = await tune(profile, job, options(tmp_path, []))
    rows = {r.label: r for r in result.rows}
    table = format_table(result)
    ref, cand = rows["reference"], rows["max_running_requests=4"]
    assert ref.status == "measured", table
    assert cand.status == "failed", table
    assert "requests failed" in cand.note and "fake engine error" in cand.note, table
    assert result.best is None, table


async def test_a_changed_tune_section_or_engine_release_is_another_tune(
        tmp_path: Path, write_profile: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"method": "EAGLE3", "draft_model": "/models/draft-a", "num_tokens": 4}
    listed = [{"max_running_requests": 4}]
    profile = write_profile(tune={"candidates": listed, "speculative": spec})
    job = write_job(tmp_path, "none")
    first: TuneResult = await tune(profile, job, options(tmp_path, []))
    assert first.ok
    # The same tune again measures nothing: every trial is reused.
    events: list[str] = []
    again = await tune(profile, job, options(tmp_path, events))
    assert not any("launching" in e for e in events) and again.rows == first.rows
    # Another draft model: the trials of the old one are not this tune's.
    write_profile(tune={"candidates": listed, "speculative": {**spec,
                                                             "draft_model": "/models/draft-b"}})
    with pytest.raises(JobError, match="another tune section"):
        await tune(profile, job, options(tmp_path, []))
    # Another engine release: neither.
    write_profile(tune={"candidates": listed, "speculative": spec})
    monkeypatch.setenv("FAKE_VERSION", "0.0.2")
    detect_install.cache_clear()  # a new release installed: asked again
    with pytest.raises(JobError, match="another engine"):
        await tune(profile, job, options(tmp_path, []))

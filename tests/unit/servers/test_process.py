"""The one liveness check and the one child-wait, shared by the launcher, the local engine
and `draftgen stop`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftgen.servers.process import pid_alive, wait_child


def test_a_pid_we_may_not_signal_is_a_live_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refuse)
    assert pid_alive(12345)


def test_wait_child_waits_up_to_its_limit_and_reaps() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    exited = wait_child(child)
    try:
        assert not exited(0.05)
        assert pid_alive(child.pid)
    finally:
        child.kill()
    assert exited(10)
    assert child.returncode is not None

"""Process plumbing shared by the local engine, the server launcher and `draftgen stop`.

A server runs as the leader of its own process group (`process_group=0`), so one signal
reaches the API server and every worker it forked. It stays in our session: this kernel
schedules CPU time per session (sched_autogroup), and an engine in a session of its own
starves a client in another.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

_LOG_TAIL_CHARS = 4000


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def answers_chat(url: str, model: str, timeout_s: float = 30) -> bool:
    """Whether a real one-token chat completion succeeds: the server is usable, not merely up."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = json.load(response)
    except (OSError, ValueError):
        # Refused while loading, 404 before routes exist, 503 while warming up.
        return False
    return isinstance(reply, dict) and bool(reply.get("choices"))


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Someone else's group now holds that id: not ours to judge, and not ours to signal.
        return False
    return True


def reap_group(pgid: int, grace_s: float) -> None:
    """Wait for a group's remaining members to leave, then SIGKILL any that stay."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)


def terminate_group(
    pgid: int,
    leader_exited: Callable[[float], bool],
    *,
    timeout_s: float,
    grace_s: float = 5.0,
) -> None:
    """SIGTERM the group, SIGKILL it if its leader has not exited within `timeout_s`.

    `leader_exited(wait_s)` waits up to `wait_s` for the leader and says whether it is gone;
    the caller knows whether it can `wait()` on it (its own child) or only poll.
    """
    signal_group(pgid, signal.SIGTERM)
    # A suspended group would hold the SIGTERM until resumed.
    signal_group(pgid, signal.SIGCONT)
    if not leader_exited(timeout_s):
        signal_group(pgid, signal.SIGKILL)
        leader_exited(grace_s)
    reap_group(pgid, grace_s)


def poll_until_gone(pid: int) -> Callable[[float], bool]:
    """A `leader_exited` for a process that is not our child (started by another draftgen)."""

    def exited(wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            if not pid_alive(pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    return exited


def wait_child(child: subprocess.Popen[bytes]) -> Callable[[float], bool]:
    """A `leader_exited` for our own child: `wait()` on it, which also reaps it."""

    def exited(wait_s: float) -> bool:
        try:
            child.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    return exited


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie: a dead child we have not reaped still has a pid (and a
    zombie has finished its work). A pid we may not signal is someone's live process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_stat_field(pid, 3) != "Z"


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), to tell a reused pid from ours; Linux only."""
    value = _proc_stat_field(pid, 22)
    return int(value) if value is not None and value.isdigit() else None


def _proc_stat_field(pid: int, number: int) -> str | None:
    """Field `number` (numbered as in proc(5), from 3) of /proc/PID/stat; None off Linux."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is parenthesised and may itself hold spaces or parentheses.
    fields = raw[raw.rfind(")") + 2 :].split()
    position = number - 3
    return fields[position] if 0 <= position < len(fields) else None


def log_tail(path: Path | None, chars: int = _LOG_TAIL_CHARS) -> str:
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return f"(log {path} unreadable)"
    return f"--- last lines of {path} ---\n{tail}"

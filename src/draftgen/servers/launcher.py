"""Launch a server from a profile, detached, and own it through files on disk.

Each server has a folder `<state_dir>/<name>/`:

    server.log     the engine's stdout and stderr, appended across restarts
    server.pid     the pid, which is also the process group id
    state.json     the handle (argv, url, pid, profile and its hash) and a status
    summary.json   what the server reported after start: capacity, KV dtype, headroom

The server leads its own process group inside our session (see `process.py`), so a later
`draftgen serve --stop`, from another process, stops it and every worker it forked. It is
ready only when a real one-token generation succeeds, not when a port opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftgen.errors import DraftgenError
from draftgen.servers.base import ServerInfo, ServerInfoError
from draftgen.servers.gpu import GpuMemory, min_headroom_gib, read_gpu_memory, visible_indices
from draftgen.servers.info import engine_for, fetch_server_info
from draftgen.servers.install import detect_install
from draftgen.servers.policy import check_profile, check_running
from draftgen.servers.preflight import Preflight, preflight
from draftgen.servers.process import (
    answers_chat,
    find_free_port,
    group_alive,
    log_tail,
    pid_alive,
    poll_until_gone,
    port_in_use,
    process_start_ticks,
    terminate_group,
)
from draftgen.servers.profile import ServerProfile, profile_hash
from draftgen.servers.summary import summary_line
from draftgen.store.atomic import write_atomic

LOG_FILE = "server.log"
PID_FILE = "server.pid"
STATE_FILE = "state.json"
SUMMARY_FILE = "summary.json"

# Servers this process started: only a parent can wait() on (and so reap) its child.
_children: dict[int, subprocess.Popen[bytes]] = {}


class LaunchError(DraftgenError):
    """A server could not be started, died while starting, or never answered."""


@dataclass(frozen=True)
class ServerHandle:
    name: str
    engine: str
    pid: int
    url: str
    port: int
    # The model name requests use: served_name, or the model path engines default to.
    model: str
    argv: tuple[str, ...]
    dir: Path
    profile_hash: str
    started_at: float
    # When the pid started (Linux): a recycled pid must never receive our signals.
    start_ticks: int | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / LOG_FILE

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["argv"] = list(self.argv)
        data["dir"] = str(self.dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerHandle:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["argv"] = tuple(fields["argv"])
        fields["dir"] = Path(fields["dir"])
        return cls(**fields)


@dataclass(frozen=True)
class Verified:
    """A server that answered, what it reported, and whether the policy let it through."""

    handle: ServerHandle
    info: ServerInfo
    gpus: list[GpuMemory] | None
    # The override stamp for run manifests; None when the KV cache is lossless.
    quality_stamp: dict[str, Any] | None
    summary: str


def state_dir_of(target: ServerProfile | Path) -> Path:
    if isinstance(target, ServerProfile):
        return target.state_path
    return target if target.is_dir() or not target.suffix else target.parent


def read_handle(target: ServerProfile | Path) -> ServerHandle | None:
    """The handle recorded for a server, alive or not; None if there never was one."""
    path = state_dir_of(target) / STATE_FILE
    try:
        data = json.loads(path.read_text())
        return ServerHandle.from_json(data["handle"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_alive(handle: ServerHandle) -> bool:
    """Whether the recorded server (or any process of its group) still runs."""
    child = _children.get(handle.pid)
    if child is not None and child.poll() is None:
        return True
    if pid_alive(handle.pid):
        ticks = process_start_ticks(handle.pid)
        # Another process now holds that pid: ours is gone.
        return handle.start_ticks is None or ticks is None or ticks == handle.start_ticks
    # The leader may be gone while workers linger; a live group id is still ours, since
    # Linux hands out no pid that is in use as a group id.
    return group_alive(handle.pid)


def running(target: ServerProfile | Path) -> ServerHandle | None:
    handle = read_handle(target)
    return handle if handle is not None and is_alive(handle) else None


def start(profile: ServerProfile, *, port: int | None = None) -> ServerHandle:
    """Start the server detached and record it; returns at once (see `wait_ready`).

    The quality policy runs first: a lossy or `auto` KV dtype never starts.
    """
    check_profile(profile)
    engine = engine_for(profile.engine)
    existing = running(profile)
    if existing is not None:
        raise LaunchError(
            f"{existing.name} is already running (pid {existing.pid}, {existing.url}); "
            "stop it first (serve --stop) or use serve --restart"
        )
    chosen = engine.port(profile) if port is None else port
    if chosen == 0:
        chosen = find_free_port()
    if port_in_use(engine.connect_host(profile), chosen):
        raise LaunchError(f"port {chosen} is already in use by another process")
    checked = run_preflight(profile)
    if not checked.ok:
        raise LaunchError("preflight: " + "; ".join(checked.problems))
    argv = engine.argv(profile, port=chosen,
                       install=detect_install(profile.engine, profile.interpreter))
    folder = profile.state_path
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / LOG_FILE
    with log_path.open("ab") as log:
        log.write(
            f"\n=== draftgen serve: starting at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(argv)}\n".encode()
        )
        log.flush()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine.env(profile),
                process_group=0,
            )
        except OSError as e:
            raise LaunchError(f"cannot run {argv[0]}: {e.strerror or e}") from None
    _children[proc.pid] = proc
    handle = ServerHandle(
        name=profile.server_name,
        engine=profile.engine,
        pid=proc.pid,
        url=engine.url(profile, chosen),
        port=chosen,
        model=profile.served_name or profile.model_path,
        argv=tuple(argv),
        dir=folder,
        profile_hash=profile_hash(profile),
        started_at=time.time(),
        start_ticks=process_start_ticks(proc.pid),
    )
    write_atomic(folder / PID_FILE, f"{proc.pid}\n".encode())
    _write_state(handle, "starting", profile=profile)
    return handle


def run_preflight(profile: ServerProfile) -> Preflight:
    """Host RAM and GPU memory for this profile, on this machine (see `preflight.py`)."""
    env = engine_for(profile.engine).env(profile)
    return preflight(profile, gpus=lambda: read_gpu_memory(only=visible_indices(env)))


def wait_ready(
    handle: ServerHandle,
    timeout_s: float = 1800.0,
    on_wait: Callable[[float], None] | None = None,
    *,
    poll_s: float = 1.0,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once a real one-token chat completion succeeds; `on_wait(elapsed_s)` per poll.

    Raises `LaunchError`, with the end of the server's log, if the server exits or does not
    answer within `timeout_s`. The server is left as it is: the caller decides to stop it.
    """
    started = monotonic()
    attempt = 0
    while True:
        attempt += 1
        if not is_alive(handle):
            child = _children.get(handle.pid)
            code = f"code {child.returncode}" if child is not None else "unknown status"
            raise LaunchError(
                f"{handle.engine} exited ({code}) while starting\n{log_tail(handle.log_path)}"
            )
        elapsed = monotonic() - started
        probe_s = max(1.0, min(30.0, timeout_s - elapsed))
        # Checked again after the answer: a stale server on the same port could answer
        # while ours is failing to bind it.
        if answers_chat(handle.url, handle.model, timeout_s=probe_s) and is_alive(handle):
            return
        elapsed = monotonic() - started
        if elapsed > timeout_s:
            raise LaunchError(
                f"{handle.engine} did not answer a chat completion within {timeout_s:g} s\n"
                f"{log_tail(handle.log_path)}"
            )
        if on_wait is not None:
            on_wait(elapsed)
        # Quick first polls for a server that is up in a second, then every poll_s.
        sleep(min(poll_s, 0.2 * attempt))


async def averify(handle: ServerHandle, profile: ServerProfile) -> Verified:
    """Read what the server runs with, apply the policy to it, and write summary.json.

    A server found running a lossy KV cache without the profile's override raises
    `QualityPolicyError`; the caller stops it.
    """
    info = await fetch_server_info(handle.url, profile=profile)
    stamp = check_running(info, profile)
    env = engine_for(profile.engine).env(profile)
    gpus = await asyncio.to_thread(read_gpu_memory, only=visible_indices(env))
    summary = summary_line(info, gpus, stamp)
    verified = Verified(handle, info, gpus, stamp, summary)
    record = {
        "summary": summary,
        "url": handle.url,
        "profile_hash": handle.profile_hash,
        "info": info.to_json(),
        "gpus": [g.to_json() for g in gpus] if gpus else None,
        "min_headroom_gib": _round(min_headroom_gib(gpus)),
        "quality_override": stamp,
        "verified_at": time.time(),
    }
    write_atomic(handle.dir / SUMMARY_FILE, _dump(record))
    _write_state(handle, "up", profile=profile)
    return verified


def verify(handle: ServerHandle, profile: ServerProfile) -> Verified:
    """`averify` for code without a running event loop (the CLI)."""
    return asyncio.run(averify(handle, profile))


def launch(
    profile: ServerProfile,
    *,
    timeout_s: float = 1800.0,
    on_wait: Callable[[float], None] | None = None,
    port: int | None = None,
) -> Verified:
    """start + wait_ready + verify; on any failure (Ctrl+C included) the server is stopped."""
    handle = start(profile, port=port)
    try:
        wait_ready(handle, timeout_s, on_wait)
        return verify(handle, profile)
    except BaseException:
        stop(handle.dir)
        raise


def stop(target: ServerProfile | Path, timeout_s: float = 30.0) -> bool:
    """SIGTERM the server's process group, SIGKILL it after `timeout_s`; False if none ran."""
    folder = state_dir_of(target)
    handle = read_handle(folder)
    if handle is None:
        return False
    was_running = is_alive(handle)
    if was_running:
        child = _children.get(handle.pid)
        terminate_group(
            handle.pid,
            _wait_child(child) if child is not None else poll_until_gone(handle.pid),
            timeout_s=timeout_s,
        )
    _children.pop(handle.pid, None)
    with contextlib.suppress(FileNotFoundError):
        (folder / PID_FILE).unlink()
    _write_state(handle, "stopped")
    return was_running


def restart(
    profile: ServerProfile,
    *,
    timeout_s: float = 1800.0,
    on_wait: Callable[[float], None] | None = None,
) -> tuple[ServerInfo | None, Verified]:
    """Stop the profile's server, start it again, verify; returns (before, after).

    `before` is what the old server reported (asked now, or its last summary.json), for a
    capacity diff. The policy is checked before anything stops, so a refused profile leaves
    the running server alone. A profile with `port: 0` keeps its previous port.
    """
    check_profile(profile)
    previous = read_handle(profile)
    before = _current_or_last_info(previous, profile)
    port = previous.port if previous is not None and profile.port == 0 else None
    stop(profile)
    return before, launch(profile, timeout_s=timeout_s, on_wait=on_wait, port=port)


def _current_or_last_info(
    previous: ServerHandle | None, profile: ServerProfile
) -> ServerInfo | None:
    if previous is None:
        return None
    if is_alive(previous):
        with contextlib.suppress(ServerInfoError):
            return asyncio.run(fetch_server_info(previous.url, profile=profile))
    try:
        data = json.loads((previous.dir / SUMMARY_FILE).read_text())
        return ServerInfo.from_json(data["info"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait_child(child: subprocess.Popen[bytes]) -> Callable[[float], bool]:
    def exited(wait_s: float) -> bool:
        try:
            child.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    return exited


def _write_state(
    handle: ServerHandle, status: str, *, profile: ServerProfile | None = None
) -> None:
    path = handle.dir / STATE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("handle", {}).get("pid") != handle.pid:
        record = {}
    record["handle"] = handle.to_json()
    record["status"] = status
    record[f"{status}_at"] = time.time()
    if profile is not None:
        record["profile"] = profile.model_dump(mode="json")
        record["profile_file"] = str(profile.source_file) if profile.source_file else None
    write_atomic(path, _dump(record))


def _dump(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode()


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)

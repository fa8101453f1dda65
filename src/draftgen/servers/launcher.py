# long: a server's whole life on the files it owns: start, readiness (with its key), verify, stop
"""Launch a server from a profile, detached, and own it through files on disk.

Each server has a folder `<state_dir>/<name>/`:

    server.log     the engine's stdout and stderr, appended across restarts
    server.pid     the pid, which is also the process group id
    state.json     the handle (argv, url, pid, profile and its hash) and a status
    summary.json   what the server reported after start: capacity, KV dtype, headroom

The server leads its own process group inside our session (see `process.py`), so a later
`draftgen serve --stop`, from another process, stops it and every worker it forked. It is
ready only when a real one-token generation succeeds, not when a port opens.
A server launched with an API key is asked with one, and no key reaches a file or an error
(`keys.py`); a 401 or 403 while it starts is an `ApiKeyRefused` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftgen.engines.info import ServerInfo, ServerInfoError
from draftgen.engines.registry import engine_for
from draftgen.errors import DraftgenError, redact
from draftgen.servers import keys
from draftgen.servers.gpu import GpuMemory, min_headroom_gib, read_gpu_memory, visible_indices
from draftgen.servers.info import fetch_server_info
from draftgen.servers.policy import check_profile, check_running
from draftgen.servers.preflight import Preflight, preflight
from draftgen.servers.process import (
    find_free_port,
    group_alive,
    log_tail,
    pid_alive,
    poll_until_gone,
    port_in_use,
    process_start_ticks,
    terminate_group,
    wait_child,
)
from draftgen.servers.profile import ServerProfile, profile_hash
from draftgen.servers.state import state_record
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


class ApiKeyRefused(LaunchError):
    """The server answered 401 or 403 while starting: the key sent is not its key."""



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
    # Its key and the secrets of its launch: never written (not in a handle read back).
    api_key: str | None = field(default=None, repr=False, compare=False)
    secrets: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def log_path(self) -> Path:
        return self.dir / LOG_FILE

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["api_key"], data["secrets"]
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
                       install=engine.installed(profile.interpreter))
    secrets = keys.launch_secrets(profile)
    shown = tuple(redact(a, secrets) for a in argv)
    folder = profile.state_path
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / LOG_FILE
    with log_path.open("ab") as log:
        log.write(
            f"\n=== draftgen serve: starting at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(shown)}\n".encode()
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
        argv=shown,
        dir=folder,
        profile_hash=profile_hash(profile),
        started_at=time.time(),
        start_ticks=process_start_ticks(proc.pid),
        api_key=keys.launch_key(profile),
        secrets=secrets,
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
    api_key: str | None = None,
    poll_s: float = 1.0,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once a real one-token chat completion succeeds; `on_wait(elapsed_s)` per poll.

    Sent with `api_key`, else its launch key; `ApiKeyRefused` at once at a 401 or 403.
    Raises `LaunchError`, with the end of the server's log, if the server exits or does not
    answer within `timeout_s`. The server is left as it is: the caller decides to stop it.
    """
    key = api_key or handle.api_key
    started = monotonic()
    attempt = 0
    while True:
        attempt += 1
        if not is_alive(handle):
            child = _children.get(handle.pid)
            code = f"code {child.returncode}" if child is not None else "unknown status"
            raise LaunchError(
                f"{handle.engine} exited ({code}) while starting\n"
                + redact(log_tail(handle.log_path), (*handle.secrets, key))
            )
        elapsed = monotonic() - started
        probe_s = max(1.0, min(30.0, timeout_s - elapsed))
        answer = keys.chat_answer(handle.url, handle.model, key, probe_s)
        if answer in (401, 403):
            raise ApiKeyRefused(keys.refusal(handle.engine, handle.url, bool(key), answer))
        # Checked again after the answer: a stale server on the same port could answer
        # while ours is failing to bind it.
        if answer == keys.READY and is_alive(handle):
            return
        elapsed = monotonic() - started
        if elapsed > timeout_s:
            raise LaunchError(
                f"{handle.engine} did not answer a chat completion within {timeout_s:g} s\n"
                + redact(log_tail(handle.log_path), (*handle.secrets, key))
            )
        if on_wait is not None:
            on_wait(elapsed)
        # Quick first polls for a server that is up in a second, then every poll_s.
        sleep(min(poll_s, 0.2 * attempt))


async def averify(handle: ServerHandle, profile: ServerProfile, *, api_key: str | None = None
                  ) -> Verified:
    """Read what the server runs with (asked as `wait_ready` asks), apply the policy, and
    write summary.json.

    A server found running a lossy KV cache without the profile's override raises
    `QualityPolicyError`; the caller stops it.
    """
    key = api_key or handle.api_key or keys.launch_key(profile)
    info = await fetch_server_info(handle.url, profile=profile, api_key=key)
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
    write_atomic(handle.dir / SUMMARY_FILE, keys.redacted_json(record, (*handle.secrets, key)))
    _write_state(handle, "up", profile=profile)
    return verified


def verify(handle: ServerHandle, profile: ServerProfile, *, api_key: str | None = None
           ) -> Verified:
    """`averify` for code without a running event loop (the CLI)."""
    return asyncio.run(averify(handle, profile, api_key=api_key))


def launch(
    profile: ServerProfile,
    *,
    timeout_s: float = 1800.0,
    on_wait: Callable[[float], None] | None = None,
    port: int | None = None,
    api_key: str | None = None,
) -> Verified:
    """start + wait_ready + verify (`api_key`: a job's); on any failure (Ctrl+C included)
    the server is stopped."""
    handle = start(profile, port=port)
    try:
        wait_ready(handle, timeout_s, on_wait, api_key=api_key)
        return verify(handle, profile, api_key=api_key)
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
            wait_child(child) if child is not None else poll_until_gone(handle.pid),
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
    before = last_info(previous, profile)
    port = previous.port if previous is not None and profile.port == 0 else None
    stop(profile)
    return before, launch(profile, timeout_s=timeout_s, on_wait=on_wait, port=port)


def last_info(
    previous: ServerHandle | None, profile: ServerProfile
) -> ServerInfo | None:
    """What the server of `previous` reports (asked now, if it runs), or its last summary."""
    if previous is None:
        return None
    if is_alive(previous):
        with contextlib.suppress(ServerInfoError):
            return asyncio.run(fetch_server_info(previous.url, profile=profile,
                                                 api_key=keys.launch_key(profile)))
    try:
        data = json.loads((previous.dir / SUMMARY_FILE).read_text())
        return ServerInfo.from_json(data["info"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_state(
    handle: ServerHandle, status: str, *, profile: ServerProfile | None = None
) -> None:
    record = state_record(handle.dir / STATE_FILE, "handle", handle.to_json(), status, profile)
    write_atomic(handle.dir / STATE_FILE, keys.redacted_json(record, (*handle.secrets, *(
        keys.launch_secrets(profile) if profile is not None else ()))))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)

"""Launch a gateway profile (`gateway_profile.py`): its workers side by side, each verified
under the quality policy like one launched server, then the gateway (`LaunchedGateway`) in
front; and own them all through files, like one server (`launcher.py`).

The gateway's folder `<state_dir>/<name>/`:

    gateway.log    the gateway's stdout and stderr, appended across restarts
    gateway.pid    its pid, which is also its process group id
    state.json     the gateway (argv, url, ports, pid), its workers' folders, the profile hash
    workers/NAME/  each worker's own server folder (server.log, server.pid, state.json, ...)

`draftgen serve` and a run's servers (`attach.py`: a job's `launch:` of a gateway profile
and its `workers:` entries) launch through `launch_gateway`: one way to start workers and
a gateway. A worker that fails cancels the others, and whatever started is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from draftgen.engines.info import ServerInfo
from draftgen.engines.registry import engine_for
from draftgen.errors import DraftgenError
from draftgen.gateways.process import LaunchedGateway
from draftgen.gateways.profile import GatewayProfile, gateway_profile_hash
from draftgen.servers.launcher import (
    STATE_FILE,
    LaunchError,
    Verified,
    last_info,
    launch,
    read_handle,
    running,
    stop,
)
from draftgen.servers.policy import check_profile
from draftgen.servers.process import (
    find_free_port,
    group_alive,
    pid_alive,
    poll_until_gone,
    process_start_ticks,
    terminate_group,
    wait_child,
)
from draftgen.servers.profile import ServerProfile
from draftgen.servers.state import state_record
from draftgen.store.atomic import write_atomic

GATEWAY_LOG = "gateway.log"
GATEWAY_PID = "gateway.pid"
# How long the gateway may take to list its (already answering) workers as ready.
GATEWAY_START_S = 120.0

# Gateways this process started and left running (`serve`): only a parent can reap them.
_children: dict[int, subprocess.Popen[bytes]] = {}

T = TypeVar("T")
# Launch one worker on a port (None: its profile's) and verify it.
LaunchOne = Callable[[ServerProfile, int | None], Awaitable[Verified]]


class LaunchCancelled(LaunchError):
    """Raised inside a launching thread whose task was cancelled: `launch` stops the server."""


@dataclass(frozen=True)
class GatewayRecord:
    """What state.json says of a launched gateway and its workers."""

    name: str
    pid: int
    url: str
    port: int
    metrics_port: int
    argv: tuple[str, ...]
    dir: Path
    # Each worker's server folder, in the profile's order.
    workers: tuple[Path, ...]
    profile_hash: str
    started_at: float
    # When the pid started (Linux): a recycled pid must never receive our signals.
    start_ticks: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(argv=list(self.argv), dir=str(self.dir),
                    workers=[str(w) for w in self.workers])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GatewayRecord:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields.update(argv=tuple(fields["argv"]), dir=Path(fields["dir"]),
                      workers=tuple(Path(w) for w in fields["workers"]))
        return cls(**fields)


@dataclass(frozen=True)
class LaunchedFleet:
    """A gateway and workers this process launched (and can reap)."""

    record: GatewayRecord
    gateway: LaunchedGateway
    workers: list[Verified]

    def stop(self) -> None:
        """Stop the gateway, then its workers."""
        _children.pop(self.record.pid, None)
        self.gateway.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.record.dir / GATEWAY_PID).unlink()
        for worker in self.workers:
            stop(worker.handle.dir)
        _write_state(self.record, "stopped")


def read_gateway(folder: Path) -> GatewayRecord | None:
    """The gateway recorded in `folder`, alive or not; None if there never was one."""
    try:
        data = json.loads((folder / STATE_FILE).read_text())
        return GatewayRecord.from_json(data["gateway"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gateway_alive(record: GatewayRecord) -> bool:
    if pid_alive(record.pid):
        ticks = process_start_ticks(record.pid)
        return record.start_ticks is None or ticks is None or ticks == record.start_ticks
    return group_alive(record.pid)


def workers_alive(record: GatewayRecord) -> int:
    return sum(running(folder) is not None for folder in record.workers)


async def run_in_thread(fn: Callable[[], T], cancel: Callable[[], None]) -> T:
    """`fn()` in a thread. When the awaiting task is cancelled, `cancel()` tells the thread
    to give up (and stop what it half-started); the cancellation goes on once it has."""
    attempt = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(attempt)
    except asyncio.CancelledError:
        cancel()
        with contextlib.suppress(BaseException):
            await attempt
        raise


async def launch_worker(
    profile: ServerProfile, port: int | None = None, *, api_key: str | None = None,
    timeout_s: float = 1800.0, on_wait: Callable[[float], None] | None = None,
) -> Verified:
    """`launcher.launch` in a thread; cancelling the task stops the half-started server (and
    one that got up meanwhile)."""
    cancelled = threading.Event()

    def waited(elapsed_s: float) -> None:
        if cancelled.is_set():
            raise LaunchCancelled(f"{profile.server_name}: launch cancelled")
        if on_wait is not None:
            on_wait(elapsed_s)

    def go() -> Verified:
        verified = launch(profile, port=port, timeout_s=timeout_s, on_wait=waited,
                          api_key=api_key)
        if cancelled.is_set():  # it got up while the others were being cancelled
            stop(verified.handle.dir)
            raise LaunchCancelled(f"{profile.server_name}: launch cancelled")
        return verified

    return await run_in_thread(go, cancelled.set)


async def launch_gateway(
    profile: GatewayProfile,
    *,
    folder: Path | None = None,
    free_ports: bool = False,
    previous: GatewayRecord | None = None,
    launch_one: LaunchOne | None = None,
    timeout_s: float = 1800.0,
    on_wait: Callable[[float], None] | None = None,
    api_key: str | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> LaunchedFleet:
    """Launch the workers side by side, then the gateway; record them in `folder` (default:
    the profile's state path). `free_ports`: every port a free one (a run); `previous`: a
    restart, where a port the profile leaves to chance (0) stays what it was. On any failure
    (Ctrl+C included) everything started is stopped."""
    folder = folder or profile.state_path
    workers = profile.workers_in(folder)
    one = launch_one or (lambda w, port: launch_worker(w, port, api_key=api_key,
                                                        timeout_s=timeout_s, on_wait=on_wait))
    ports = [find_free_port() if free_ports else _worker_port(w, previous, i)
             for i, w in enumerate(workers)]
    gateway: LaunchedGateway | None = None
    try:
        verified = await _side_by_side(workers, ports, one)
        settings = profile.gateway
        gateway = LaunchedGateway(
            [v.handle.url for v in verified], backend=profile.backend,
            log_path=folder / GATEWAY_LOG, python=profile.interpreter, host=settings.host,
            port=0 if free_ports else _gateway_port(settings.port, previous, "port"),
            metrics_port=0 if free_ports else _gateway_port(settings.metrics_port, previous,
                                                            "metrics_port"))
        log(f"launching a gateway in front of {len(verified)} workers on {gateway.url} …")
        started = gateway
        await run_in_thread(lambda: started.start(GATEWAY_START_S), started.cancel)
        assert gateway.pid is not None
        record = GatewayRecord(
            name=profile.server_name, pid=gateway.pid, url=gateway.url, port=gateway.port,
            metrics_port=gateway.metrics_port, argv=tuple(gateway.argv), dir=folder,
            workers=tuple(v.handle.dir for v in verified),
            profile_hash=gateway_profile_hash(profile), started_at=time.time(),
            start_ticks=gateway.start_ticks)
        if gateway.process is not None:
            _children[gateway.pid] = gateway.process
        write_atomic(folder / GATEWAY_PID, f"{gateway.pid}\n".encode())
        _write_state(record, "up", profile)
    except BaseException:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            stop(w)
        raise
    return LaunchedFleet(record, gateway, verified)


async def _side_by_side(workers: list[ServerProfile], ports: list[int | None],
                        one: LaunchOne) -> list[Verified]:
    """Every worker launched at once; the first failure cancels the others and is raised,
    naming its worker."""

    async def named(worker: ServerProfile, port: int | None) -> Verified:
        try:
            return await one(worker, port)
        except LaunchCancelled:
            raise
        except DraftgenError as e:
            with contextlib.suppress(Exception):
                e = type(e)(f"worker {worker.server_name}: {e}")
            raise e from None

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(named(w, p)) for w, p in zip(workers, ports, strict=True)]
    except BaseExceptionGroup as failed:
        causes = [e for e in failed.exceptions if not isinstance(e, LaunchCancelled)]
        raise (causes or list(failed.exceptions))[0] from None
    return [t.result() for t in tasks]


def _worker_port(worker: ServerProfile, previous: GatewayRecord | None, i: int) -> int | None:
    """None (the profile's port), or where the profile leaves it to chance (0) the port the
    worker had before a restart."""
    if engine_for(worker.engine).port(worker) or previous is None or i >= len(previous.workers):
        return None
    handle = read_handle(previous.workers[i])
    return handle.port if handle is not None else None


def _gateway_port(port: int, previous: GatewayRecord | None, which: str) -> int:
    """The profile's port, or where it is 0 (free) the one it had before a restart."""
    return port or (int(getattr(previous, which)) if previous is not None else 0)


def stop_gateway(folder: Path, timeout_s: float = 30.0) -> GatewayRecord | None:
    """Stop the gateway recorded in `folder`, then every worker; the record if anything of it
    was running, else None."""
    record = read_gateway(folder)
    if record is None:
        return None
    was_running = gateway_alive(record)
    child = _children.pop(record.pid, None)
    if was_running:
        terminate_group(record.pid,
                        wait_child(child) if child is not None else poll_until_gone(record.pid),
                        timeout_s=timeout_s)
    with contextlib.suppress(FileNotFoundError):
        (folder / GATEWAY_PID).unlink()
    for worker in record.workers:
        was_running = stop(worker, timeout_s) or was_running
    _write_state(record, "stopped")
    return record if was_running else None


def restart_gateway(profile: GatewayProfile, **launch_options: Any
                    ) -> tuple[list[ServerInfo | None], LaunchedFleet]:
    """Stop the profile's gateway and workers, launch them again; returns what each worker
    reported before (asked now, or its last summary) and the new fleet."""
    workers = profile.workers_in(profile.state_path)
    for w in workers:  # a refused profile leaves what runs alone
        check_profile(w)
    previous = read_gateway(profile.state_path)
    before = [last_info(read_handle(w.state_path), w) for w in workers]
    stop_gateway(profile.state_path)
    for w in workers:  # a worker the last launch did not record (it failed midway)
        stop(w)
    fleet = asyncio.run(launch_gateway(profile, previous=previous, **launch_options))
    return before, fleet


def _write_state(record: GatewayRecord, status: str, profile: GatewayProfile | None = None
                 ) -> None:
    path = record.dir / STATE_FILE
    data = state_record(path, "gateway", record.to_json(), status, profile)
    record.dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2).encode())

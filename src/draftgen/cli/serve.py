"""`draftgen serve` after its arguments are checked (`cli/servers.py`): it prints and
returns the exit code.

    0  done (server up, stopped, or argv printed)
    1  the server failed to start, answer, or report its settings
    2  a bad profile or option, or the quality policy refused (also with --dry-run)
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from draftgen.engines.info import ServerInfoError
from draftgen.engines.memory import MemoryModelError
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.gateways.base import GatewayError
from draftgen.gateways.launch import (
    GatewayRecord,
    gateway_alive,
    launch_gateway,
    read_gateway,
    restart_gateway,
    stop_gateway,
    workers_alive,
)
from draftgen.gateways.profile import (
    GatewayProfile,
    gateway_profile_hash,
    load_any_profile,
)
from draftgen.gateways.registry import gateway_for
from draftgen.servers.launcher import (
    LaunchError,
    Verified,
    launch,
    read_handle,
    run_preflight,
    running,
    verify,
)
from draftgen.servers.launcher import restart as restart_server
from draftgen.servers.launcher import stop as stop_server
from draftgen.servers.policy import QualityPolicyError, check_profile
from draftgen.servers.prediction import memory_facts, predict_profile
from draftgen.servers.profile import ServerProfile, default_state_dir, profile_hash
from draftgen.servers.summary import capacity_change

_PLAIN_WAIT_EVERY_S = 15.0


def serve(
    profile: Path | None,
    dry_run: bool = False,
    stop: bool = False,
    restart: bool = False,
    timeout_s: float = 1800.0,
) -> int:
    """Launch, verify, stop or restart the server a profile describes; returns the exit code.

    Takes what `cli/servers.py` checked: at most one of dry_run, stop, restart, and a
    profile unless stopping."""
    out, err = sys.stdout, sys.stderr
    try:
        if stop:
            return _stop(profile, out)
        assert profile is not None, "cli/servers.py asks for a profile"
        loaded = load_any_profile(profile)
        gateway = loaded if isinstance(loaded, GatewayProfile) else None
        for server in gateway.workers if gateway is not None else [loaded]:
            assert isinstance(server, ServerProfile)
            stamp = check_profile(server)
            if stamp:
                who = f"{server.server_name}: " if gateway is not None else ""
                print(
                    f"warning: {who}lossy KV cache {stamp['kv_cache_dtype']} "
                    "allowed by the profile's quality override; every run manifest using this "
                    "server records it",
                    file=err,
                )
        if gateway is not None:
            return _serve_gateway(gateway, dry_run, restart, timeout_s, out, err)
        assert isinstance(loaded, ServerProfile)
        if dry_run:
            return _dry_run(loaded, out)
        if restart:
            return _restart(loaded, timeout_s, out, err)
        return _start(loaded, timeout_s, out, err)
    except (JobError, QualityPolicyError) as e:
        print(e, file=err)
        return 2
    except (LaunchError, ServerInfoError, GatewayError) as e:
        print(e, file=err)
        return 1


def _dry_run(profile: ServerProfile, out: TextIO) -> int:
    engine = engine_for(profile.engine)
    install = engine.installed(profile.interpreter)
    print(shlex.join(engine.argv(profile, install=install)), file=out)
    unread = "" if install.flags is not None else "; flags for the newest known release"
    print(f"# engine: {install.describe()}{unread}", file=out)
    for key, value in sorted(profile.env.items()):
        print(f"# env {key}={value}", file=out)
    if profile.port == 0:
        print("# --port 0: a free port is chosen at start", file=out)
    print(f"# run without a shell; state, log and pid under {profile.state_path}", file=out)
    for line in prediction_lines(profile):
        print(f"# {line}", file=out)
    # The profile may be for another machine: what this one lacks is said, not fatal.
    checked = run_preflight(profile)
    for line in checked.checks:
        print(f"# preflight: {line}", file=out)
    for line in checked.problems:
        print(f"# preflight would refuse this on this machine: {line}", file=out)
    return 0


def prediction_lines(profile: ServerProfile) -> list[str]:
    """What the memory model predicts this profile holds, and what it rests on."""
    try:
        facts = memory_facts(profile)
        prediction = predict_profile(profile, facts)
    except MemoryModelError as e:
        return [f"predicted KV tokens: unknown ({e})"]
    return [f"predicted KV tokens: {prediction.kv_tokens:,}",
            f"  {prediction.describe()}", *(f"  {s}" for s in facts.sources())]


def _start(profile: ServerProfile, timeout_s: float, out: TextIO, err: TextIO) -> int:
    current = running(profile)
    if current is not None:
        if current.profile_hash != profile_hash(profile):
            print(
                f"{current.name} is running (pid {current.pid}, {current.url}) with other "
                "settings; use --restart to apply this profile",
                file=err,
            )
            return 1
        _report(verify(current, profile), out, note="already running")
        return 0
    try:
        verified = launch(profile, timeout_s=timeout_s, on_wait=waiting_line(err))
    finally:
        _end_waiting_line(err)
    _report(verified, out)
    return 0


def _restart(profile: ServerProfile, timeout_s: float, out: TextIO, err: TextIO) -> int:
    try:
        before, after = restart_server(profile, timeout_s=timeout_s, on_wait=waiting_line(err))
    finally:
        _end_waiting_line(err)
    _report(after, out, note="restarted")
    print(capacity_change(before, after.info), file=out)
    return 0


def _stop(target: Path | None, out: TextIO) -> int:
    if target is None:
        folders = sorted(p for p in default_state_dir().glob("*") if p.is_dir())
    elif target.is_dir():
        folders = [target]
    else:
        folders = [load_any_profile(target).state_path]
    stopped = 0
    for folder in folders:
        if read_gateway(folder) is not None:
            record = stop_gateway(folder)
            if record is not None:
                print(f"stopped {record.name}: the gateway (pid {record.pid}, {record.url}) and "
                      f"{len(record.workers)} workers", file=out)
                stopped += 1
            continue
        handle = read_handle(folder)
        if handle is not None and stop_server(folder):
            print(f"stopped {handle.name} (pid {handle.pid}, {handle.url})", file=out)
            stopped += 1
    if not stopped:
        where = folders[0] if len(folders) == 1 else default_state_dir()
        print(f"no server running ({where})", file=out)
    return 0


def _report(verified: Verified, out: TextIO, note: str = "", prefix: str = "") -> None:
    handle, info = verified.handle, verified.info
    print(f"{prefix}{verified.summary}", file=out)
    print(
        f"  {info.engine} {info.version or '?'} at {handle.url}, model {info.model}, "
        f"pid {handle.pid}{f' ({note})' if note else ''}",
        file=out,
    )
    print(f"  KV dtype: {info.kv_dtype_note}", file=out)
    print(f"  log {handle.log_path}; summary {handle.dir / 'summary.json'}", file=out)


def _serve_gateway(profile: GatewayProfile, dry_run: bool, restart: bool, timeout_s: float,
                   out: TextIO, err: TextIO) -> int:
    """A gateway profile: its workers side by side, then the gateway in front."""
    if dry_run:
        return _gateway_dry_run(profile, out)
    if restart:
        try:
            before, fleet = restart_gateway(profile, timeout_s=timeout_s,
                                            on_wait=waiting_line(err))
        finally:
            _end_waiting_line(err)
        _report_gateway(fleet.record, fleet.workers, out, note="restarted")
        for was, now in zip(before, fleet.workers, strict=True):
            change = capacity_change(was, now.info).replace("\n", "\n  ")
            print(f"{now.handle.name}: {change}", file=out)
        return 0
    record = read_gateway(profile.state_path)
    if record is not None and (gateway_alive(record) or workers_alive(record)):
        up, alive = gateway_alive(record), workers_alive(record)
        if record.profile_hash != gateway_profile_hash(profile):
            print(f"{record.name} is running (gateway pid {record.pid}, {record.url}) with "
                  "other settings; use --restart to apply this profile", file=err)
            return 1
        if not up or alive < len(record.workers):
            print(f"{record.name} is partly running (gateway {'up' if up else 'down'}, "
                  f"{alive} of {len(record.workers)} workers); use --restart, or --stop",
                  file=err)
            return 1
        verified = []
        # The same hash: the same workers, in the same order (their names may differ).
        for folder, worker in zip(record.workers, profile.workers_in(record.dir), strict=True):
            handle = running(folder)
            assert handle is not None, "workers_alive counted it"
            verified.append(verify(handle, worker))
        _report_gateway(record, verified, out, note="already running")
        return 0
    try:
        fleet = asyncio.run(launch_gateway(profile, timeout_s=timeout_s,
                                           on_wait=waiting_line(err)))
    finally:
        _end_waiting_line(err)
    _report_gateway(fleet.record, fleet.workers, out)
    return 0


def _gateway_dry_run(profile: GatewayProfile, out: TextIO) -> int:
    workers = profile.workers_in(profile.state_path)
    urls = []
    for i, worker in enumerate(workers, 1):
        print(f"# worker {i} of {len(workers)}: {worker.server_name} ({worker.source_file})",
              file=out)
        _dry_run(worker, out)
        urls.append(engine_for(worker.engine).url(worker))
    settings = profile.gateway
    print(f"# the gateway, started once every worker answers: {profile.server_name}", file=out)
    print(shlex.join(gateway_for().command(profile.interpreter, host=settings.host,
                                           port=settings.port,
                                           metrics_port=settings.metrics_port,
                                           worker_urls=urls, backend=profile.backend)),
          file=out)
    for flag, port in (("--port", settings.port), ("--prometheus-port", settings.metrics_port)):
        if port == 0:
            print(f"# {flag} 0: a free port is chosen at start", file=out)
    if any(engine_for(w.engine).port(w) == 0 for w in workers):
        print("# a worker URL with port 0 gets the port its worker starts on", file=out)
    print(f"# run without a shell; state, log and pid under {profile.state_path}", file=out)
    return 0


def _report_gateway(record: GatewayRecord, workers: list[Verified], out: TextIO,
                    note: str = "") -> None:
    print(f"gateway up at {record.url} — {len(workers)} workers, pid {record.pid}"
          f"{f' ({note})' if note else ''}", file=out)
    print(f"  log {record.dir / 'gateway.log'}; state {record.dir / 'state.json'}", file=out)
    for verified in workers:
        _report(verified, out, note=note, prefix=f"{verified.handle.name}: ")


def waiting_line(err: TextIO) -> Callable[[float], None]:
    """A live `waiting… N s` line on a terminal; an occasional plain line in a log."""
    tty = err.isatty()
    last = [-_PLAIN_WAIT_EVERY_S]

    def on_wait(elapsed_s: float) -> None:
        if tty:
            print(f"\rwaiting for a real generation… {elapsed_s:.0f} s", end="", file=err,
                  flush=True)
        elif elapsed_s - last[0] >= _PLAIN_WAIT_EVERY_S:
            last[0] = elapsed_s
            print(f"waiting for a real generation… {elapsed_s:.0f} s", file=err, flush=True)

    return on_wait


def _end_waiting_line(err: TextIO) -> None:
    if err.isatty():
        print(file=err)

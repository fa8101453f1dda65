"""`draftgen serve` after its arguments are checked (`cli/servers.py`): it prints and
returns the exit code.

    0  done (server up, stopped, or argv printed)
    1  the server failed to start, answer, or report its settings
    2  a bad profile or option, or the quality policy refused (also with --dry-run)
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from draftgen.errors import JobError
from draftgen.servers.engines.info import ServerInfoError
from draftgen.servers.engines.memory import MemoryModelError
from draftgen.servers.engines.registry import engine_for
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
from draftgen.servers.profile import ServerProfile, default_state_dir, load_profile, profile_hash
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
        loaded = load_profile(profile)
        stamp = check_profile(loaded)
        if stamp:
            print(
                f"warning: lossy KV cache {stamp['kv_cache_dtype']} allowed by the profile's "
                "quality override; every run manifest using this server records it",
                file=err,
            )
        if dry_run:
            return _dry_run(loaded, out)
        if restart:
            return _restart(loaded, timeout_s, out, err)
        return _start(loaded, timeout_s, out, err)
    except (JobError, QualityPolicyError) as e:
        print(e, file=err)
        return 2
    except (LaunchError, ServerInfoError) as e:
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
        folders = [load_profile(target).state_path]
    stopped = 0
    for folder in folders:
        handle = read_handle(folder)
        if handle is not None and stop_server(folder):
            print(f"stopped {handle.name} (pid {handle.pid}, {handle.url})", file=out)
            stopped += 1
    if not stopped:
        where = folders[0] if len(folders) == 1 else default_state_dir()
        print(f"no server running ({where})", file=out)
    return 0


def _report(verified: Verified, out: TextIO, note: str = "") -> None:
    handle, info = verified.handle, verified.info
    print(verified.summary, file=out)
    print(
        f"  {info.engine} {info.version or '?'} at {handle.url}, model {info.model}, "
        f"pid {handle.pid}{f' ({note})' if note else ''}",
        file=out,
    )
    print(f"  KV dtype: {info.kv_dtype_note}", file=out)
    print(f"  log {handle.log_path}; summary {handle.dir / 'summary.json'}", file=out)


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

"""Runs in the background: start one detached, find it again, stop it gracefully.

The run's own lock file (`OUT/.lock`) holds its pid and is locked while it runs, so
`status` and `stop` work for any run, detached or not, and never signal a stale pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from draftgen.errors import StoreError
from draftgen.servers.process import pid_alive
from draftgen.store.reading import is_running, lock_pid

LOG = "run.log"
PID = "run.pid"
DETACHED_ENV = "DRAFTGEN_DETACHED"


def start_detached(args: Sequence[str], out_dir: Path) -> int:
    """Start `draftgen run ARGS --out OUT` in its own session, logging to OUT/run.log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOG, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "draftgen", "run", *args, "--out", str(out_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            # Its own process group, but the same session: with the kernel's per-session
            # CPU groups (sched_autogroup), a run in a session of its own starved commands
            # of the user's session, `status` included, for over a minute. It ignores
            # SIGHUP instead, to outlive the terminal.
            process_group=0, env={**os.environ, DETACHED_ENV: "1"},
        )
    (out_dir / PID).write_text(f"{proc.pid}\n")
    return proc.pid


def running_pid(out_dir: Path) -> int | None:
    """The pid of the run holding OUT's lock, or None when no run holds it."""
    return lock_pid(out_dir) if is_running(out_dir) else None


def stop_run(out_dir: Path, *, timeout_s: float = 120.0) -> bool:
    """SIGTERM the run (it finishes in-flight requests within its grace period) and wait
    until it has let go of the directory. False when no run was going."""
    pid = running_pid(out_dir)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    # Done when the process is gone, not only the lock: it still prints its summary and
    # stops any server it launched after letting go of the directory.
    while is_running(out_dir) or pid_alive(pid):
        if time.monotonic() > deadline:
            raise StoreError(f"{out_dir}: the run (pid {pid}) did not stop within "
                             f"{timeout_s:.0f}s; signal it again to abort")
        time.sleep(0.2)
    return True

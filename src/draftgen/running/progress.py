"""Renders run snapshots: a live table on a terminal, one plain line at a time in a log."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from draftgen.clock import format_duration
from draftgen.running.stats import ServerSnapshot, Snapshot


def server_text(s: ServerSnapshot) -> str:
    if not s.up:
        return f"{s.url} DOWN"
    parts = [f"{s.url}", f"{s.in_flight} in flight"]
    if s.load_error is not None:
        parts.append(f"load poll failing ({s.load_error})")
    if s.running is not None:
        parts.append(f"running {s.running}, queued {s.waiting or 0}")
    if s.kv_usage is not None:
        parts.append(f"KV {s.kv_usage:.0%}")
    if s.capacity is not None:
        parts.append(f"of {s.capacity:,}")
    if s.target is not None:
        parts.append(f"target {s.target:,.0f}")
    return " ".join(parts)


def plain_line(snap: Snapshot) -> str:
    planned = snap.total("planned")
    done = snap.total("done")
    line = (
        f"[{format_duration(snap.elapsed_s)}] done {done}/{planned} "
        f"failed {snap.total('failed')} truncated {snap.total('truncated')} "
        f"pending {snap.total('pending')} in-flight {snap.in_flight} | "
        f"{snap.tok_s_window:,.0f} tok/s (1 min), {snap.tok_s_overall:,.0f} overall | "
        f"ETA {format_duration(snap.eta_s)}"
    )
    for srv in snap.servers:
        line += f" | {server_text(srv)}"
    return f"{line} | {snap.note}" if snap.note else line


def table(snap: Snapshot) -> Table:
    t = Table(title=None, expand=False)
    for col in ("category", "done", "failed", "truncated", "pending", "in flight", "out tokens"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for c in snap.categories:
        t.add_row(c.name, f"{c.done}/{c.planned}", str(c.failed), str(c.truncated),
                  str(c.pending), str(c.in_flight), f"{c.output_tokens:,}")
    t.caption = "\n".join([
        f"{snap.tok_s_window:,.0f} tok/s over the last minute, {snap.tok_s_overall:,.0f} overall · "
        f"{snap.in_flight} in flight · retries {snap.retries} · "
        f"elapsed {format_duration(snap.elapsed_s)} · ETA {format_duration(snap.eta_s)}",
        *(server_text(srv) for srv in snap.servers),
        *([snap.note] if snap.note else []),
    ])
    return t


class ProgressView:
    """Runs as a task beside the run; `live` picks the terminal view."""

    def __init__(self, snapshot: Callable[[], Snapshot], *, live: bool | None = None,
                 interval_s: float = 30.0, stream: TextIO | None = None) -> None:
        self._snapshot = snapshot
        self._stream = stream or sys.stderr
        self._live = self._stream.isatty() if live is None else live
        self._interval_s = interval_s

    async def run(self) -> None:
        if self._live:
            console = Console(file=self._stream)
            with Live(table(self._snapshot()), console=console, refresh_per_second=2) as live:
                try:
                    while True:
                        await asyncio.sleep(0.5)
                        live.update(table(self._snapshot()))
                finally:
                    live.update(table(self._snapshot()))
        else:
            try:
                while True:
                    await asyncio.sleep(self._interval_s)
                    print(plain_line(self._snapshot()), file=self._stream, flush=True)
            finally:
                # The last line, so that a log always ends with the final figures.
                print(plain_line(self._snapshot()), file=self._stream, flush=True)

"""What a run directory holds, read without the job file (while a run writes or after)."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson
from rich.table import Table

from draftgen.quality.checks import quality_flags
from draftgen.store.reading import (
    UNVERIFIED,
    RejectedCounts,
    count_rejected,
    current_entries,
    is_running,
    lock_pid,
    read_manifest,
    seeds_ignored_note,
)
from draftgen.store.tally import CategoryTally, current, tally


@dataclass(slots=True)
class CategoryStatus(CategoryTally):
    # Done samples with an output check flag other than truncation (left out of exports).
    flagged: int = 0


@dataclass(slots=True)
class RunStatus:
    out_dir: str
    running: bool
    total: int = 0
    done: int = 0
    failed: int = 0
    truncated: int = 0
    pending: int = 0
    output_tokens: int = 0
    flagged: int = 0
    # Entries of rejected.jsonl: source rows set aside by the plan (one per row) and, once
    # a server's context is known, samples whose prompt cannot fit it (one per sample).
    rejected: RejectedCounts = field(default_factory=RejectedCounts)
    stale: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    # Done samples per output check code, truncation codes included.
    flags: dict[str, int] = field(default_factory=dict)
    categories: dict[str, CategoryStatus] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    # The running run's latest view of its servers (live.json), while it runs.
    live: dict[str, Any] | None = None
    # What the user should know about how the data was made (seeds ignored, ...).
    notes: list[str] = field(default_factory=list)
    # Done samples per server configuration id ("unverified" where none was recorded).
    configurations: dict[str, int] = field(default_factory=dict)
    # Done samples per server that wrote them (a gateway's worker: the one that served it).
    servers: dict[str, int] = field(default_factory=dict)

    def configuration_lines(self) -> list[str]:
        """One line per server configuration that wrote samples, with what it was."""
        known = self.manifest.get("configurations") or {}
        return [f"  {cid}  {describe_configuration(known.get(cid))}: {n:,} samples"
                for cid, n in sorted(self.configurations.items(), key=lambda kv: -kv[1])]

    def table(self) -> Table:
        """Per category and in total: what `draftgen status` shows first."""
        alive = f"running (pid {self.pid})" if self.running else "not running"
        t = Table(title=f"{self.out_dir} — {alive}")
        for c in ("category", "total", "done", "failed", "truncated", "flagged", "pending",
                  "output tokens"):
            t.add_column(c, justify="left" if c == "category" else "right")
        rows: list[tuple[str, CategoryStatus | RunStatus]] = [*self.categories.items(),
                                                              ("total", self)]
        for name, row in rows:
            t.add_row(name, f"{row.total:,}", f"{row.done:,}", f"{row.failed:,}",
                      f"{row.truncated:,}", f"{row.flagged:,}", f"{row.pending:,}",
                      f"{row.output_tokens:,}")
        return t

    def text_lines(self) -> list[str]:
        """What `draftgen status` prints under its table (plain text, no markup)."""
        lines = []
        if self.failures:
            lines.append("failures: " + ", ".join(f"{k} {v}" for k, v in self.failures.items()))
        if self.flags:
            lines.append("flags: " + ", ".join(f"{k} {v}" for k, v in self.flags.items()))
        # What rejected.jsonl holds, named apart: source rows the plan set aside, and
        # prompts too long for the server's context (one entry per sample).
        lines.append(f"set aside (see rejected.jsonl): {self.rejected.rows} source rows, "
                     f"{self.rejected.too_long} prompts too long for the server's context")
        if len(self.configurations) > 1 or any(c != UNVERIFIED for c in self.configurations):
            lines.append("samples per server configuration (regenerate one: run JOB "
                         "--redo-config ID):")
            lines += self.configuration_lines()
        if len(self.servers) > 1:
            lines.append("samples per server: " + ", ".join(
                f"{url} {n:,}" for url, n in sorted(self.servers.items(), key=lambda kv: -kv[1])))
        lines += [f"note: {note}" for note in self.notes]
        return lines + self.live_lines()

    def live_lines(self) -> list[str]:
        if not self.live:
            return []
        lines = [f"scheduler {self.live.get('scheduler')}, {self.live.get('in_flight')} in "
                 f"flight, {self.live.get('tok_s', 0):,.0f} tok/s"]
        for url, s in (self.live.get("servers") or {}).items():
            state = "up" if s.get("up") else "DOWN"
            load = ", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}"
                             for k, v in s.items() if k != "up" and v is not None)
            lines.append(f"  {url} {state}: {load}")
        return lines

    def as_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("categories", "manifest")}
        d["categories"] = {
            k: {f.name: getattr(v, f.name) for f in fields(v)} for k, v in self.categories.items()
        }
        # `rejected` stays the count of rejected.jsonl's entries; `set_aside` names them apart.
        d["rejected"] = self.rejected.total
        d["set_aside"] = {"rows": self.rejected.rows, "too_long": self.rejected.too_long}
        runs = self.manifest.get("runs") or []
        d["runs"] = len(runs)
        d["last_run"] = runs[-1] if runs else None
        return d


def describe_configuration(configuration: dict[str, Any] | None) -> str:
    """`sglang 0.5.23, /models/Kimi-K2.5, KV fp8_e4m3` (what set it apart, in words)."""
    if not configuration:
        return "not verified (no configuration recorded)"
    c = configuration
    parts = [f"{c.get('engine')} {c.get('version') or '?'}", str(c.get("model_path") or "?"),
             f"KV {c.get('kv_dtype') or '?'}"]
    parts += [f"{k} {c[k]}" for k in ("dtype", "quantization", "speculative") if c.get(k)]
    return ", ".join(parts)


def read_status(out_dir: Path) -> RunStatus:
    plan, entries = current_entries(out_dir)
    st = RunStatus(str(out_dir), is_running(out_dir), manifest=read_manifest(out_dir))
    if (note := seeds_ignored_note(st.manifest)) is not None:
        st.notes.append(note)
    if st.running:
        st.pid = lock_pid(out_dir)
        with contextlib.suppress(OSError, orjson.JSONDecodeError):
            st.live = orjson.loads((out_dir / "live.json").read_bytes())
    counted = tally(current(plan, entries), CategoryStatus)
    st.categories = counted.categories
    failures: Counter[str] = Counter()
    flags: Counter[str] = Counter()
    configurations: Counter[str] = Counter()
    servers: Counter[str] = Counter()
    for category, e in counted.done:
        configurations[e.configuration or UNVERIFIED] += 1
        servers[e.server or "unknown"] += 1
        if e.flags:
            flags.update(e.flags)
            st.categories[category].flagged += bool(quality_flags(e.flags))
    for _, e in counted.failed:
        failures[(e.reason or "error").split(":", 1)[0]] += 1
    for name in ("total", "done", "failed", "truncated", "pending", "output_tokens", "flagged"):
        setattr(st, name, sum(getattr(c, name) for c in st.categories.values()))
    planned_ids = {p["id"] for p in plan}
    st.stale = sum(1 for i in entries if i not in planned_ids)
    st.failures = dict(failures)
    st.flags = dict(flags)
    st.configurations = dict(configurations)
    st.servers = dict(servers)
    st.rejected = count_rejected(out_dir)
    return st

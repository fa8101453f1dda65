"""What a run directory holds, read without the job file (while a run writes or after)."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from draftgen.quality.checks import quality_flags
from draftgen.store.reading import (
    UNVERIFIED,
    current_entries,
    is_running,
    lock_pid,
    seeds_ignored_note,
)
from draftgen.store.run_store import REJECTED, read_manifest


@dataclass(slots=True)
class CategoryStatus:
    total: int = 0
    done: int = 0
    failed: int = 0
    truncated: int = 0
    pending: int = 0
    output_tokens: int = 0
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
    rejected: int = 0
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

    def configuration_lines(self) -> list[str]:
        """One line per server configuration that wrote samples, with what it was."""
        known = self.manifest.get("configurations") or {}
        return [f"  {cid}  {describe_configuration(known.get(cid))}: {n:,} samples"
                for cid, n in sorted(self.configurations.items(), key=lambda kv: -kv[1])]

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
            k: {f: getattr(v, f) for f in v.__slots__} for k, v in self.categories.items()
        }
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
    failures: Counter[str] = Counter()
    flags: Counter[str] = Counter()
    configurations: Counter[str] = Counter()
    planned_ids = set()
    for p in plan:
        planned_ids.add(p["id"])
        cat = st.categories.setdefault(p["category"], CategoryStatus())
        cat.total += 1
        e = entries.get(p["id"])
        if e is None or e.fp != p["fingerprint"]:
            cat.pending += 1
        elif e.status == "done":
            cat.done += 1
            cat.truncated += e.trunc
            cat.output_tokens += e.otok
            configurations[e.cfg or UNVERIFIED] += 1
            if e.flags:
                flags.update(e.flags)
                cat.flagged += bool(quality_flags(e.flags))
        else:
            cat.failed += 1
            failures[(e.reason or "error").split(":", 1)[0]] += 1
    for name in ("total", "done", "failed", "truncated", "pending", "output_tokens", "flagged"):
        setattr(st, name, sum(getattr(c, name) for c in st.categories.values()))
    st.stale = sum(1 for i in entries if i not in planned_ids)
    st.failures = dict(failures)
    st.flags = dict(flags)
    st.configurations = dict(configurations)
    try:
        st.rejected = sum(1 for line in (out_dir / REJECTED).read_bytes().splitlines() if line)
    except FileNotFoundError:
        st.rejected = 0
    return st

"""Reading a run directory from outside the run that writes it: no lock taken, nothing
repaired (`status`, `export`, the card and calibration read this way while a run goes on)."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

import orjson

from draftgen.errors import StoreError
from draftgen.store.ledger import LedgerEntry, load_ledger
from draftgen.store.run_store import LEDGER, LOCK, PLAN


def is_running(out_dir: Path) -> bool:
    try:
        with open(out_dir / LOCK, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except FileNotFoundError:
        return False


def lock_pid(out_dir: Path) -> int | None:
    """The pid the last run wrote into its lock file (meaningful while it is locked)."""
    try:
        return int((out_dir / LOCK).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def iter_plan(out_dir: Path) -> list[dict[str, Any]]:
    try:
        data = (out_dir / PLAN).read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{out_dir}: not a draftgen run directory (no {PLAN})") from None
    return [orjson.loads(line) for line in data.splitlines() if line]


def current_entries(out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, LedgerEntry]]:
    """The plan, and the ledger's latest entry per id (callers compare the fingerprint with
    the plan's to tell a current record from a stale one)."""
    plan = iter_plan(out_dir)
    entries = load_ledger(out_dir / LEDGER, repair=False).entries
    return plan, entries


# How status, the card and --redo-config name records whose server was not verified.
UNVERIFIED = "unverified"


def seeds_ignored_note(manifest: dict[str, Any]) -> str | None:
    """What to tell a user whose job sends per-sample seeds to a server that ignores them
    (SGLang without --enable-deterministic-inference); None when nothing is wrong."""
    seed = ((manifest.get("job") or {}).get("sampling") or {}).get("seed")
    if seed is None:
        return None
    urls = sorted({str(s.get("url")) for r in manifest.get("runs") or []
                   for s in r.get("servers") or []
                   if isinstance(s, dict) and s.get("seeds_honoured") is False})
    if not urls:
        return None
    return (f"per-sample seeds ignored by this engine ({', '.join(urls)}): SGLang honours a "
            "request's seed only when launched with --enable-deterministic-inference "
            "(profile: deterministic_inference: true)")

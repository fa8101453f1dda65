"""Reading a run directory from outside the run that writes it: no lock taken, nothing
repaired (`status`, `export`, the card and calibration read this way while a run goes on)."""

from __future__ import annotations

import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from draftgen.errors import StoreError
from draftgen.store.ledger import LedgerEntry, load_ledger
from draftgen.store.run_store import LEDGER, LOCK, MANIFEST, PLAN, REJECTED


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


def check_run_dir(out_dir: Path, *, planned: bool = False) -> None:
    """A StoreError unless `out_dir` is a directory (a run directory, or one to become one)
    and, when `planned`, one a run has written its plan into."""
    if not out_dir.exists():
        raise StoreError(f"{out_dir}: no such run directory")
    if not out_dir.is_dir():
        raise StoreError(f"{out_dir}: not a directory (give the run directory, the job's "
                         "output)")
    if planned and not (out_dir / PLAN).exists():
        raise StoreError(f"{out_dir}: not a draftgen run directory (no {PLAN})")


def iter_plan(out_dir: Path) -> list[dict[str, Any]]:
    """Every plan row; a StoreError naming the file and line for anything that is not one
    (every reader indexes a row's id, category and fingerprint without looking)."""
    check_run_dir(out_dir, planned=True)
    path = out_dir / PLAN
    try:
        data = path.read_bytes()
    except OSError as e:
        raise StoreError(f"{path}: cannot read: {e.strerror}") from None
    rows = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            row = None
        if not (isinstance(row, dict) and isinstance(row.get("id"), str)
                and isinstance(row.get("category"), str)
                and isinstance(row.get("fingerprint"), str)):
            # plan.jsonl is replaced whole, so this is damage from outside, not a kill.
            raise StoreError(f"{path}: line {n} is not a plan row (torn or corrupt); "
                             "`draftgen run` on its job rewrites it")
        rows.append(row)
    return rows


def read_manifest(out_dir: Path) -> dict[str, Any]:
    """The run's manifest ({} before the first run wrote one); a StoreError if damaged."""
    path = out_dir / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise StoreError(f"{path}: cannot read: {e.strerror}") from None
    try:
        manifest = orjson.loads(data)
    except orjson.JSONDecodeError:
        manifest = None
    if not isinstance(manifest, dict):
        raise StoreError(f"{path}: not a JSON object (torn or corrupt); move it aside and "
                         "the next `draftgen run` starts a new one (the ledger and shards keep "
                         "every sample)")
    return manifest


def current_entries(out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, LedgerEntry]]:
    """The plan, and the ledger's latest entry per id (callers compare the fingerprint with
    the plan's to tell a current record from a stale one). The manifest is checked too, so
    every reader of a run directory refuses a damaged one before it reads anything else."""
    plan = iter_plan(out_dir)
    read_manifest(out_dir)
    try:
        entries = load_ledger(out_dir / LEDGER, repair=False).entries
    except OSError as e:
        raise StoreError(f"{out_dir / LEDGER}: cannot read: {e.strerror}") from None
    return plan, entries


# The reason rejected.jsonl gives a prompt set aside as too long for a server's context
# (planning/replan.py); every other entry is a source row that could not become a sample.
TOO_LONG = "prompt_too_long"


@dataclass(frozen=True)
class RejectedCounts:
    rows: int = 0  # source rows the plan set aside (bad rows)
    too_long: int = 0  # prompts set aside as too long for the server's context

    @property
    def total(self) -> int:
        return self.rows + self.too_long


def count_rejected(out_dir: Path) -> RejectedCounts:
    """The entries of rejected.jsonl, named apart (none where there is no file yet); a
    StoreError naming the file where it cannot be read, as for every other file of a run
    directory."""
    path = out_dir / REJECTED
    try:
        lines = [line for line in path.read_bytes().splitlines() if line]
    except FileNotFoundError:
        return RejectedCounts()
    except OSError as e:
        raise StoreError(f"{path}: cannot read: {e.strerror}") from None
    too_long = sum(1 for line in lines if _reason(line).startswith(TOO_LONG))
    return RejectedCounts(len(lines) - too_long, too_long)


def _reason(line: bytes) -> str:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return ""
    reason = row.get("reason") if isinstance(row, dict) else None
    return reason if isinstance(reason, str) else ""


# How status, the card and --redo-config name records whose server was not verified.
UNVERIFIED = "unverified"


def seeds_ignored_note(manifest: dict[str, Any]) -> str | None:
    """What to tell a user whose job sends per-sample seeds to a server that ignores them
    (SGLang without --enable-deterministic-inference); None when nothing is wrong."""
    seed = ((manifest.get("job") or {}).get("sampling") or {}).get("seed")
    if seed is None:
        return None
    ignoring = [s for r in manifest.get("runs") or [] for s in r.get("servers") or []
                if isinstance(s, dict) and s.get("seeds_honoured") is False]
    if not ignoring:
        return None
    urls = sorted({str(s.get("url")) for s in ignoring})
    engines = " and ".join(sorted({str(s.get("engine")) for s in ignoring}))
    return (f"per-sample seeds ignored by this engine ({', '.join(urls)}): {engines} honours "
            "a request's seed only when launched with --enable-deterministic-inference "
            "(profile: deterministic_inference: true)")

"""Choosing which records to export, and writing them through a format.

Records are read in plan order, the latest ledger entry per id, and only where its request
fingerprint still matches the plan. Samples flagged by the output checks are left out
unless asked for; truncation keeps its own rule (`include_truncated`). The file is written
beside its destination and renamed into place, so a failed export leaves no half file.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from draftgen.errors import DraftgenError, HostError, JobError, StoreError
from draftgen.export import registry
from draftgen.export.base import ExportContext, ExportOptions
from draftgen.quality.checks import check_turns, quality_flags
from draftgen.store.reading import current_entries, read_manifest
from draftgen.store.run_store import LEDGER, LOCK, MANIFEST, PLAN, REJECTED
from draftgen.store.shards import SHARD_DIR, read_at

# A destination the user spelled wrong (exit 2), as against one this machine will not let
# us write (permissions, a read-only or full file system: exit 1).
_BAD_PATH = {errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG}
RUN_FILES = frozenset({LEDGER, LOCK, MANIFEST, PLAN, REJECTED})


@dataclass(frozen=True, slots=True)
class ExportSummary:
    to: Path
    exported: int
    failed: int
    truncated: int
    empty: int
    pending: int
    flagged: int = 0
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        return (f"exported {self.exported} samples to {self.to}; left out: {self.failed} failed, "
                f"{self.truncated} truncated, {self.flagged} flagged, {self.empty} empty, "
                f"{self.pending} pending" + "".join(f"\nnote: {n}" for n in self.notes))


def _in_source_order(plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plan rows by source file (in the order the job reads them) and row; the samples of
    one prompt keep their plan order (the sort is stable)."""
    files: dict[str, int] = {}

    def position(row: dict[str, Any]) -> tuple[int, int]:
        name, _, line = str(row.get("source") or "").rpartition(":")
        return files.setdefault(name, len(files)), int(line) if line.isdigit() else -1

    for row in plan:
        position(row)  # number the files in plan order first
    return sorted(plan, key=position)


def _export_ids(plan: list[dict[str, Any]], mode: str) -> dict[str, str]:
    """draftgen id → the id to write, where that differs: the source's own, when unique."""
    if mode != "source":
        return {}
    owners: dict[str, list[str]] = {}
    for p in plan:
        if p.get("source_id") is not None:
            owners.setdefault(str(p["source_id"]), []).append(p["id"])
    mapped = {ids[0]: sid for sid, ids in owners.items() if len(ids) == 1}
    # A source id that is another row's draftgen id would name two rows: keep draftgen's.
    unmapped = {p["id"] for p in plan} - mapped.keys()
    return {pid: sid for pid, sid in mapped.items() if sid not in unmapped}


def _write_error(to: Path, e: OSError) -> DraftgenError:
    what = e.strerror or type(e).__name__
    if e.errno in _BAD_PATH:
        file = next((a for a in to.parents if a.exists() and not a.is_dir()), None)
        if file is not None:
            what = f"{file} is a file, not a directory"
        return JobError(f"--to: cannot write {to}: {what}")
    # Its folder exists (made just now if need be), so the file system refused the file.
    return HostError(f"--to: cannot write {to}: {what}")


def _check_destination(to: Path, out_dir: Path) -> None:
    if to.is_dir() or not to.name:
        raise JobError(f"--to: {to} is a directory; give the file to write")
    # Writing over the run's own files would lose the run: an export goes anywhere else.
    target, run = to.resolve(), out_dir.resolve()
    if (target.parent == run and target.name in RUN_FILES) or run / SHARD_DIR in target.parents:
        raise JobError(f"--to: {to} is one of the run's own files; write the export elsewhere")


# Each option with what it may be (ExportOptions' Literal types, checked at run time).
_CHOICES = {"reasoning": ("inline", "field", "drop"), "ids": ("draftgen", "source"),
            "order": ("plan", "source")}


def export_run(out_dir: Path, to: Path, opts: ExportOptions) -> ExportSummary:
    formats = registry.formats()
    fmt = formats.get(opts.format)
    if fmt is None:
        raise JobError(f"--format: {opts.format!r} is not one of {', '.join(sorted(formats))}")
    for name, allowed in _CHOICES.items():
        if (value := getattr(opts, name)) not in allowed:
            raise JobError(f"--{name}: {value!r} is not one of {', '.join(allowed)}")
    _check_destination(to, out_dir)
    plan, entries = current_entries(out_dir)
    manifest = read_manifest(out_dir)
    fmt.prepare(ExportContext(out_dir, manifest), opts)
    # Partitions whose job says `truncation: keep`: their truncated samples are exported,
    # tagged `"truncated": true`.
    keep = {name for name, p in ((manifest.get("job") or {}).get("partitions") or {}).items()
            if p.get("truncation") == "keep"}
    counts = {"failed": 0, "truncated": 0, "empty": 0, "pending": 0, "exported": 0,
              "flagged": 0}
    files: dict[str, BinaryIO] = {}
    if opts.order == "source":
        plan = _in_source_order(plan)
    ids = _export_ids(plan, opts.ids)

    def rows() -> Iterator[dict[str, Any]]:
        for p in plan:
            e = entries.get(p["id"])
            if e is None or e.fingerprint != p["fingerprint"]:
                counts["pending"] += 1
            elif e.status != "done" or e.shard is None:
                counts["failed"] += 1
            elif e.truncated and not (opts.include_truncated or e.partition in keep):
                counts["truncated"] += 1
            else:
                try:
                    rec = read_at(out_dir, e.shard, e.offset, e.length, files)
                except (OSError, orjson.JSONDecodeError):
                    raise StoreError(f"{out_dir / e.shard}: the record of {p['id']} (bytes "
                                     f"{e.offset}+{e.length}) cannot be read; the shard is "
                                     "damaged or missing") from None
                if not all((t["content"] or "").strip() for t in rec["turns"]):
                    counts["empty"] += 1
                    continue
                # Ledgers written before the checks existed carry no flags: check now.
                flags = e.flags if e.flags is not None else check_turns(rec["turns"])
                if quality_flags(flags) and not opts.include_flagged:
                    counts["flagged"] += 1
                    continue
                counts["exported"] += 1
                row = fmt.row(rec, opts)
                row["id"] = ids.get(p["id"], p["id"])
                if e.truncated:
                    row["truncated"] = True
                yield row

    tmp = to.with_name(f".{to.name}.tmp")
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            fmt.write(rows(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, to)
    except OSError as e:
        raise _write_error(to, e) from None
    finally:
        for fh in files.values():
            fh.close()
        with contextlib.suppress(OSError):  # where it could not be made, nothing to remove
            tmp.unlink(missing_ok=True)
    return ExportSummary(to, counts["exported"], counts["failed"], counts["truncated"],
                         counts["empty"], counts["pending"], counts["flagged"],
                         tuple(fmt.notes()))

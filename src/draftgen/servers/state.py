"""What a launched process's state file (`state.json`) says: the server's, or a gateway's
(gateways/launch.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol


class RecordedProfile(Protocol):
    """A profile a state file records: a server's, or a gateway profile (gateways/)."""

    @property
    def source_file(self) -> Path | None: ...
    def model_dump(self, *, mode: str) -> dict[str, Any]: ...


def state_record(path: Path, key: str, entry: dict[str, Any], status: str,
                 profile: RecordedProfile | None) -> dict[str, Any]:
    """What a launched process's state file says next: the one there, if it is this pid's
    (`entry["pid"]` under `key`), with `entry`, `status` and its time, and the profile."""
    record: dict[str, Any]
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    if record.get(key, {}).get("pid") != entry.get("pid"):
        record = {}
    record.update({key: entry, "status": status, f"{status}_at": time.time()})
    if profile is not None:
        record["profile"] = profile.model_dump(mode="json")
        record["profile_file"] = str(profile.source_file) if profile.source_file else None
    return record

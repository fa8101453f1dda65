"""Small files are replaced whole: write a temp file, fsync it, rename over, fsync the dir."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from draftgen.errors import DiskError


def disk_error(out_dir: Path, e: OSError) -> DiskError:
    what = {errno.ENOSPC: "no space left on device", errno.EIO: "I/O error",
            errno.EDQUOT: "disk quota exceeded"}.get(e.errno or 0, e.strerror or str(e))
    return DiskError(
        f"writing to {out_dir} failed: {what}. Dispatch stopped; every sample recorded before "
        "this is intact. Free space (or fix the disk) and run the same command again to continue."
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Either the old file or the new one is there afterwards, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(path.parent, e) from None

"""GPU memory headroom from nvidia-smi: how much room a higher memory fraction would have.

Only meaningful on the machine that runs the server, so `serve` asks it right after a
launch. Without nvidia-smi (a CPU machine, another vendor) there is simply no answer.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

QUERY = [
    "nvidia-smi",
    "--query-gpu=index,memory.total,memory.used",
    "--format=csv,noheader,nounits",
]


@dataclass(frozen=True)
class GpuMemory:
    index: int
    total_mib: int
    used_mib: int

    @property
    def free_mib(self) -> int:
        return self.total_mib - self.used_mib

    @property
    def headroom_gib(self) -> float:
        return self.free_mib / 1024

    def to_json(self) -> dict[str, float | int]:
        return {
            "index": self.index,
            "total_mib": self.total_mib,
            "used_mib": self.used_mib,
            "headroom_gib": round(self.headroom_gib, 2),
        }


def parse_nvidia_smi(text: str) -> list[GpuMemory]:
    """Rows of `index, total, used` in MiB; rows without numbers (MIG shows [N/A]) are skipped."""
    gpus: list[GpuMemory] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3 or not all(c.isdigit() for c in cells):
            continue
        index, total, used = (int(c) for c in cells)
        gpus.append(GpuMemory(index, total, used))
    return gpus


def visible_indices(env: dict[str, str]) -> set[int] | None:
    """The GPU indices CUDA_VISIBLE_DEVICES selects, when it names them by number."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None or not value.strip():
        return None
    parts = [p.strip() for p in value.split(",")]
    return {int(p) for p in parts} if all(p.isdigit() for p in parts) else None


def read_gpu_memory(
    *,
    only: Collection[int] | None = None,
    run: Callable[[Sequence[str]], str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> list[GpuMemory] | None:
    """Memory of each GPU (only those in `only`, if given); None without nvidia-smi."""
    if which("nvidia-smi") is None:
        return None
    try:
        text = (run or _run)(QUERY)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = parse_nvidia_smi(text)
    if only is not None:
        gpus = [g for g in gpus if g.index in only]
    return gpus or None


def min_headroom_gib(gpus: Sequence[GpuMemory] | None) -> float | None:
    return min(g.headroom_gib for g in gpus) if gpus else None


def _run(argv: Sequence[str]) -> str:
    return subprocess.run(
        list(argv), capture_output=True, text=True, check=True, timeout=30
    ).stdout

"""Before a launch: does the machine have the host RAM and GPU memory the profile asks for?

Checked before anything starts (`serve`, `serve --dry-run`, a run's embedded launch), so a
profile that cannot start is refused in a second with the largest setting that fits, not
after minutes of weight loading:

- **HiCache host RAM.** SGLang's `--hicache-size` is decimal GB (1e9 bytes) *per rank*, and
  every rank on the host pins its own pool. SGLang refuses to start unless ranks × size fits
  in what is available (MemAvailable, bounded by the cgroup's limit) minus a 10 GiB reserve
  (`HICACHE_HOST_MEMORY_RESERVE_BYTES` in SGLang 0.5.23).
- **GPU memory.** The engine claims `mem_fraction` of each GPU's total at start; memory
  other processes already hold on a visible GPU makes that fail. (Headroom *after* load is
  read and shown by `serve` once the server is up.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftgen.servers.gpu import GpuMemory
from draftgen.servers.profile import ServerProfile

HICACHE_RESERVE_BYTES = 10 * 1024**3
GB = 10**9
_GIB = 1024**3


@dataclass(frozen=True)
class Preflight:
    checks: list[str] = field(default_factory=list)  # what was checked, and that it fits
    problems: list[str] = field(default_factory=list)  # why the launch is refused

    @property
    def ok(self) -> bool:
        return not self.problems


def gpu_ranks(profile: ServerProfile) -> int:
    """GPU processes the server runs on this host: TP × DP, or TP alone when DP is the
    attention's (the DP ranks then share the TP group's GPUs)."""
    return profile.tp * (1 if profile.dp_attention else profile.dp)


def read_available_memory(root: Path = Path("/")) -> int | None:
    """Bytes of host RAM a new process can take: MemAvailable, bounded by the cgroup."""
    available: int | None = None
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        available = None
    headroom = _cgroup_headroom(root / "sys/fs/cgroup")
    if available is None:
        return headroom
    return available if headroom is None else min(available, headroom)


def _cgroup_headroom(cgroup: Path) -> int | None:
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        # v2 says "max"; v1 says a number near 2^63 for "no limit".
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - usage)
    return None


def check_host_ram(profile: ServerProfile, available_bytes: int | None) -> Preflight:
    hicache = profile.hierarchical_cache
    # Only engines with the "hierarchical_cache" feature let a profile enable it.
    if not hicache.enabled or hicache.host_gb_per_rank is None:
        return Preflight()
    ranks = gpu_ranks(profile)
    need = ranks * hicache.host_gb_per_rank * GB
    asked = (f"hierarchical_cache.host_gb_per_rank {hicache.host_gb_per_rank} × {ranks} ranks "
             f"= {need / GB:,.0f} GB of host RAM (+ the engine's 10 GiB reserve)")
    if available_bytes is None:
        return Preflight([f"{asked}: free host RAM unknown here, not checked"])
    usable = available_bytes - HICACHE_RESERVE_BYTES
    have = f"{available_bytes / GB:,.1f} GB available"
    if need <= usable:
        return Preflight([f"{asked}: fits ({have})"])
    largest = max(0, usable // ranks // GB)
    fix = (f"the largest that fits is host_gb_per_rank: {largest}" if largest >= 1
           else "no HiCache host pool fits: disable hierarchical_cache or free memory")
    return Preflight(problems=[f"{asked}, but only {have}: {fix}"])


def check_gpu_memory(profile: ServerProfile, gpus: Sequence[GpuMemory] | None) -> Preflight:
    if not gpus:
        return Preflight(["GPU memory: no nvidia-smi answer here, not checked"])
    fraction = profile.mem_fraction
    if fraction is None:
        low = min(gpus, key=lambda g: g.free_mib / g.total_mib)
        return Preflight([f"GPU memory: the engine's default fraction; GPU {low.index} has "
                          f"{low.free_mib / 1024:.1f} of {low.total_mib / 1024:.1f} GiB free"])
    short = [g for g in gpus if fraction * g.total_mib > g.free_mib]
    if not short:
        return Preflight([f"GPU memory: mem_fraction {fraction:g} fits on {len(gpus)} GPU(s)"])
    largest = math.floor(min(g.free_mib / g.total_mib for g in gpus) * 100) / 100
    worst = ", ".join(f"GPU {g.index} {g.free_mib / 1024:.1f} of {g.total_mib / 1024:.1f} GiB "
                      "free" for g in short[:4])
    return Preflight(problems=[
        f"mem_fraction {fraction:g} needs {fraction:.0%} of each GPU, but other processes "
        f"hold memory ({worst}); the largest that fits is mem_fraction: {largest:g}"])


def preflight(profile: ServerProfile, *,
              available_bytes: Callable[[], int | None] | None = None,
              gpus: Callable[[], Sequence[GpuMemory] | None] = lambda: None) -> Preflight:
    available = (available_bytes or read_available_memory)()
    parts = [check_host_ram(profile, available), check_gpu_memory(profile, gpus())]
    return Preflight([c for p in parts for c in p.checks], [x for p in parts for x in p.problems])

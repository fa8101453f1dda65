"""Inference servers: profiles, launch, what a running server reports, quality policy.

    profile.py    ServerProfile (YAML, validated) and its hash; tune_section.py its `tune:`
    info.py       fetch_server_info: what a running server uses (engine detected by URL)
    preflight.py  host RAM and GPU memory before a launch
    prediction.py what a profile will hold before a GPU exists (engines/memory.py, fed)
    policy.py     refuse lossy or `auto` KV cache dtypes; the override's manifest stamp
    launcher.py   start / wait_ready / verify / stop / restart, state under state_dir/<name>
    state.py      what a launched process's state file says (a server's or a gateway's)
    keys.py       a launched server's API key, the secrets of a launch, readiness with the key
    gpu.py        per-GPU memory headroom from nvidia-smi
    summary.py    the one-line summary and what a restart changed
    process.py    process-group plumbing shared with the local engine and the gateways

What each engine means is the engine family (`draftgen.engines`), what a gateway means the
gateway family (`draftgen.gateways`); a run's servers are `running/attach.py`.
"""

from draftgen.engines.base import Engine
from draftgen.engines.info import ServerInfo, ServerInfoError
from draftgen.engines.registry import engine_for
from draftgen.servers.gpu import GpuMemory, read_gpu_memory
from draftgen.servers.info import check_health, fetch_server_info, manifest_record
from draftgen.servers.launcher import (
    LaunchError,
    ServerHandle,
    Verified,
    averify,
    launch,
    read_handle,
    restart,
    running,
    start,
    stop,
    verify,
    wait_ready,
)
from draftgen.servers.policy import QualityPolicyError, check_profile, check_running
from draftgen.servers.profile import ServerProfile, load_profile, profile_hash
from draftgen.servers.summary import capacity_change, summary_line

__all__ = [
    "Engine",
    "GpuMemory",
    "LaunchError",
    "QualityPolicyError",
    "ServerHandle",
    "ServerInfo",
    "ServerInfoError",
    "ServerProfile",
    "Verified",
    "averify",
    "capacity_change",
    "check_health",
    "check_profile",
    "check_running",
    "engine_for",
    "fetch_server_info",
    "launch",
    "load_profile",
    "manifest_record",
    "profile_hash",
    "read_gpu_memory",
    "read_handle",
    "restart",
    "running",
    "start",
    "stop",
    "summary_line",
    "verify",
    "wait_ready",
]

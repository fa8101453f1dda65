"""Inference servers: profiles, launch argv, what a running server reports, quality policy.

    profile.py    ServerProfile (YAML, validated) and its hash
    base.py       the Engine contract and ServerInfo; sglang.py and vllm.py implement it
    info.py       fetch_server_info: what a running server uses (engine detected by URL)
    policy.py     refuse lossy or `auto` KV cache dtypes; the override's manifest stamp
    launcher.py   start / wait_ready / verify / stop / restart, state under state_dir/<name>
    gpu.py        per-GPU memory headroom from nvidia-smi
    summary.py    the one-line summary and what a restart changed
    serve_cli.py  `draftgen serve`
    process.py    process-group plumbing shared with the local engine
"""

from draftgen.servers.base import Engine, ServerInfo, ServerInfoError
from draftgen.servers.gpu import GpuMemory, read_gpu_memory
from draftgen.servers.info import check_health, engine_for, fetch_server_info, manifest_record
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
from draftgen.servers.serve_cli import serve
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
    "serve",
    "start",
    "stop",
    "summary_line",
    "verify",
    "wait_ready",
]

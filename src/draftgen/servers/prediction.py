"""What a profile will hold, before a GPU exists: the memory model (`engines/memory.py`) fed
from the profile, its files and this machine, each fact with where it came from.

- the model's shape: `memory.model_config`, else `model_path`'s config.json;
- the weights: `memory.weights_gb`, else the checkpoint's safetensors index (`total_size`),
  else its `.safetensors` files;
- one GPU's memory: the profile's last verify (`summary.json` in its state folder), else
  `memory.gpu_memory_mib`, else the driver (nvidia-smi);
- the reserve (the model's one unknown): fitted to `memory.measured`, else to the last
  verify's KV capacity, else 0 and said so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from draftgen.engines.memory import (
    GB,
    MIB,
    Hardware,
    Layout,
    MeasuredPoint,
    MemoryModelError,
    ModelShape,
    Prediction,
    fit_reserve,
    predict,
)
from draftgen.engines.registry import engine_for
from draftgen.servers.gpu import GpuMemory, read_gpu_memory
from draftgen.servers.launcher import SUMMARY_FILE
from draftgen.servers.profile import ServerProfile


@dataclass(frozen=True)
class ProfileMemory:
    """The facts one profile's predictions rest on."""

    shape: ModelShape
    hardware: Hardware
    reserve_bytes: float
    reserve_source: str

    def sources(self) -> list[str]:
        return [f"model shape: {self.shape.source}",
                f"GPU memory: {self.hardware.gpu_bytes / GB:.2f} GB ({self.hardware.gpu_source})",
                f"weights: {self.hardware.weights_bytes / GB:.1f} GB "
                f"({self.hardware.weights_source})",
                f"reserve: {self.reserve_bytes / GB:.2f} GB ({self.reserve_source})"]


def layout_of(profile: ServerProfile) -> Layout:
    attn_dp = profile.dp if profile.dp_attention else 1
    replicas = 1 if profile.dp_attention else profile.dp
    return Layout(tp=profile.tp, dp=replicas, attn_dp=attn_dp, dcp=profile.dcp)


def fraction_of(profile: ServerProfile) -> float:
    return profile.mem_fraction or engine_for(profile.engine).default_mem_fraction


def memory_facts(profile: ServerProfile, *,
                 gpus: Callable[[], Sequence[GpuMemory] | None] = read_gpu_memory
                 ) -> ProfileMemory:
    """Everything the memory model needs for `profile`; MemoryModelError names what is
    missing and the profile field that would give it."""
    memory = profile.memory
    config = (Path(memory.model_config_path) if memory and memory.model_config_path
              else Path(profile.model_path).expanduser())
    if not (config / "config.json" if config.is_dir() else config).exists():
        raise MemoryModelError(
            f"no config.json for {profile.model_path} on this machine: give "
            "memory.model_config (a copy of the model's config.json)")
    shape = ModelShape.read(config)
    verified = _last_verify(profile)
    gpu, gpu_source = _gpu_bytes(profile, verified, gpus)
    weights, weights_source = _weights_bytes(profile)
    hardware = Hardware(gpu, weights, gpu_source, weights_source)
    point = _measured_point(profile, verified)
    if point is None:
        return ProfileMemory(shape, hardware, 0.0,
                             "not fitted: no measured point (memory.measured, or a verify "
                             "of this profile), 0 assumed")
    reserve = fit_reserve(shape, hardware, point)
    return ProfileMemory(shape, hardware, reserve, f"fitted to {point.source}")


def predict_profile(profile: ServerProfile, facts: ProfileMemory, *,
                    fraction: float | None = None, kv_cache_dtype: str | None = None,
                    layout: Layout | None = None) -> Prediction:
    """KV tokens `profile` will hold, with any of its settings changed."""
    return predict(facts.shape, facts.hardware, layout or layout_of(profile),
                   fraction if fraction is not None else fraction_of(profile),
                   kv_cache_dtype or profile.kv_cache_dtype,
                   reserve_bytes=facts.reserve_bytes, reserve_source=facts.reserve_source)


def _last_verify(profile: ServerProfile) -> dict[str, Any] | None:
    try:
        data = json.loads((profile.state_path / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("info"), dict) else None


def _gpu_bytes(profile: ServerProfile, verified: dict[str, Any] | None,
               gpus: Callable[[], Sequence[GpuMemory] | None]) -> tuple[float, str]:
    seen = (verified or {}).get("gpus")
    if isinstance(seen, list) and seen and isinstance(seen[0], dict) \
            and isinstance(seen[0].get("total_mib"), int):
        return seen[0]["total_mib"] * MIB, "the last verify of this profile"
    if profile.memory and profile.memory.gpu_memory_mib:
        return profile.memory.gpu_memory_mib * MIB, "the profile's memory.gpu_memory_mib"
    found = gpus()
    if found:
        return min(g.total_mib for g in found) * MIB, "nvidia-smi on this machine"
    raise MemoryModelError("no GPU visible here: give memory.gpu_memory_mib (one GPU's "
                           "memory as nvidia-smi shows it)")


def _weights_bytes(profile: ServerProfile) -> tuple[float, str]:
    if profile.memory and profile.memory.weights_gb:
        return profile.memory.weights_gb * GB, "the profile's memory.weights_gb"
    folder = Path(profile.model_path).expanduser()
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        total = index["metadata"]["total_size"]
        return float(total), f"{folder}/model.safetensors.index.json total_size"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if files:
        return float(sum(f.stat().st_size for f in files)), f"the .safetensors files in {folder}"
    raise MemoryModelError(f"no checkpoint for {profile.model_path} on this machine: give "
                           "memory.weights_gb (its safetensors index's total_size / 1e9)")


def _measured_point(profile: ServerProfile, verified: dict[str, Any] | None
                    ) -> MeasuredPoint | None:
    measured = profile.memory.measured if profile.memory else None
    if measured is not None:
        attn_dp = measured.dp if measured.dp_attention else 1
        layout = Layout(tp=measured.tp or profile.tp,
                        dp=1 if measured.dp_attention else measured.dp,
                        attn_dp=attn_dp, dcp=measured.dcp)
        where = measured.source or "the profile's memory.measured"
        return MeasuredPoint(measured.kv_tokens, measured.mem_fraction,
                             measured.kv_cache_dtype, layout,
                             f"{measured.kv_tokens:,} KV tokens at mem_fraction "
                             f"{measured.mem_fraction:g}, {measured.kv_cache_dtype} KV, "
                             f"{layout.describe()} ({where})")
    info = (verified or {}).get("info") or {}
    tokens, fraction = info.get("kv_tokens"), info.get("mem_fraction")
    if not isinstance(tokens, int) or not isinstance(fraction, int | float) or not tokens:
        return None
    base = layout_of(profile)
    layout = replace(base, tp=info.get("tp") or base.tp)
    dtype = info.get("kv_dtype") or profile.kv_cache_dtype
    return MeasuredPoint(tokens, float(fraction), dtype, layout,
                         f"{tokens:,} KV tokens at mem_fraction {fraction:g}, {dtype} KV "
                         "(the last verify of this profile)")

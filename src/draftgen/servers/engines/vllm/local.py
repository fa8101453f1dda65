"""vLLM's CPU build serving a local model on 127.0.0.1: the flags and environment of the
engine that runs the demo and the tests (`engine/local.py` starts and stops it)."""

from __future__ import annotations

from pathlib import Path

MODULE = "vllm.entrypoints.openai.api_server"


def cpu_server_flags(model_dir: Path, *, served_name: str, port: int, max_model_len: int,
                     num_blocks: int | None) -> list[str]:
    args = [
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len), "--enforce-eager",
        # One access-log line per request would grow the log without bound in benchmarks.
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    return args


def cpu_server_env(kv_cache_gib: int) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}

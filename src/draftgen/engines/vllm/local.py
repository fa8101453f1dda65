"""vLLM's CPU build serving a local model on 127.0.0.1: the flags and environment of the
engine that runs the demo and the tests (`local/server.py` starts and stops it)."""

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
        # The model runs in the engine-core process (with VLLM_ENABLE_V1_MULTIPROCESSING=0
        # below; the CPU build forces a worker process of its own otherwise): one process
        # fewer to start, 28 s to ready instead of 40 s on a 2-core EPYC, and ~1.5x the
        # tokens a second there (920-960 against 590-630, 16 requests of 300 tokens). Its
        # one OpenMP thread is then not pinned to a core (VLLM_CPU_OMP_THREADS_BIND does
        # nothing): two engines on one machine share its cores as the kernel schedules them.
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    if num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    return args


def cpu_server_env(kv_cache_gib: int) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

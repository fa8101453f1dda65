"""`draftgen serve` with the real local engine: serve, read capacity from the server, restart
with a different KV size and see it change, stop with nothing left behind."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.cli.serve import serve
from draftgen.servers import fetch_server_info, load_profile, read_handle, stop
from draftgen.servers.process import group_alive

BLOCK_TOKENS = 128  # vLLM's CPU block size


def write_profile(path: Path, model_dir: Path, state_dir: Path, blocks: int) -> Path:
    profile: dict[str, Any] = {
        "engine": "vllm",
        "name": "tiny-serve-test",
        "model_path": str(model_dir),
        "served_name": "tiny",
        "model_dtype": "bfloat16",
        "context_length": 1024,
        "port": 0,
        "python": sys.executable,
        "state_dir": str(state_dir),
        # The model in the engine-core process, as the local CPU example: ready sooner.
        "extra_args": ["--enforce-eager", "--disable-uvicorn-access-log",
                       "--distributed-executor-backend", "uni",
                       "--num-gpu-blocks-override", str(blocks)],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    }
    path.write_text(yaml.safe_dump(profile))
    return path


def summary(profile_path: Path) -> dict[str, Any]:
    folder = load_profile(profile_path).state_path
    data: dict[str, Any] = json.loads((folder / "summary.json").read_text())
    return data


def test_serve_restart_with_a_bigger_cache_and_stop(
    engine_installed: None,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_profile(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "state", blocks=16)
    try:
        assert serve(path, timeout_s=240) == 0
        out = capsys.readouterr().out
        assert out.startswith("up — 2,048 KV tokens, bf16 KV")
        first = read_handle(load_profile(path))
        assert first is not None and group_alive(first.pid)
        recorded = summary(path)["info"]
        assert recorded["kv_tokens"] == 16 * BLOCK_TOKENS
        assert recorded["kv_dtype"] == "bfloat16"
        assert recorded["kv_dtype_setting"] == "bfloat16"
        assert recorded["context_length"] == 1024

        # Anyone can ask the server itself, without the profile.
        info = asyncio.run(fetch_server_info(first.url))
        assert (info.engine, info.model, info.kv_tokens) == ("vllm", "tiny", 2048)
        assert info.version

        write_profile(path, tiny_model_dir, tmp_path / "state", blocks=32)
        assert serve(path, restart=True, timeout_s=240) == 0
        out = capsys.readouterr().out
        assert out.startswith("up — 4,096 KV tokens, bf16 KV")
        assert "KV tokens: 2,048 → 4,096 (+2,048, ×2.00)" in out
        second = read_handle(load_profile(path))
        assert second is not None
        # Same URL for whoever uses the server; the old process group is gone.
        assert second.port == first.port
        assert not group_alive(first.pid)
        assert summary(path)["info"]["kv_tokens"] == 32 * BLOCK_TOKENS

        assert serve(path, stop=True) == 0
        assert capsys.readouterr().out.startswith("stopped tiny-serve-test")
        assert not group_alive(second.pid)
        assert not (load_profile(path).state_path / "server.pid").exists()
    finally:
        # Never leave an engine on a 2-core machine other tests share.
        stop(load_profile(path))

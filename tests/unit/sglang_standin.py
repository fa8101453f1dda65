"""A stand-in for an SGLang server, which cannot run on CPU: it answers as SGLang 0.5.x does.

- `GET /health`, `/health_generate`: 503 while starting (the first `starting_polls`
  requests to any generating endpoint), then 200 — SGLang's health runs a real generation.
- `GET /server_info` (and the older `/get_server_info`; with `old_api` only that one): every
  server argument, the scheduler info (`max_total_num_tokens` of one DP rank,
  `max_req_input_len`), `internal_states` per DP rank with `memory_usage.token_capacity`,
  and `version`.
- `GET /v1/loads` (0.5.8+, absent with `old_api`): one entry per DP rank.
- `POST /v1/chat/completions`: a one-token reply.
- `GET /metrics` only with `--enable-metrics`, `GET /v1/models`.

Capacity follows the arguments like the real thing in direction: proportional to
`--mem-fraction-static`, doubled by an fp8 KV cache. It runs in-process (`start_standin`)
or as a process launched with SGLang's own argv (`main`), for the launcher tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

TOKENS_PER_MEM_FRACTION = 200_000


@dataclass
class StandinConfig:
    model_path: str = "/models/Kimi-K2.5"
    served_model_name: str | None = "kimi-k2.5"
    tp_size: int = 8
    dp_size: int = 1
    enable_dp_attention: bool = False
    mem_fraction_static: float = 0.88
    kv_cache_dtype: str = "bf16"
    dtype: str = "auto"
    enable_hierarchical_cache: bool = False
    hicache_size: int = 0
    max_running_requests: int | None = None
    context_length: int | None = None
    reasoning_parser: str | None = None
    enable_metrics: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    version: str = "0.5.9"
    # Requests to generating endpoints answered 503 before the server is "up".
    starting_polls: int = 0
    # Only /get_server_info, no /v1/loads: an SGLang before 0.5.8.
    old_api: bool = False
    # Older releases report no token_capacity in internal_states.
    states_have_capacity: bool = True
    # Rank i gets capacity - i * jitter, to tell per-rank sources apart.
    rank_jitter: int = 0
    seen: list[str] = field(default_factory=list)

    def rank_capacity(self, rank: int) -> int:
        per_rank = int(self.mem_fraction_static * TOKENS_PER_MEM_FRACTION)
        if self.kv_cache_dtype.startswith(("fp8", "fp4")):
            per_rank *= 2
        return per_rank - rank * self.rank_jitter

    def rank_max_running(self) -> int:
        total = self.max_running_requests or 2048
        return total // self.dp_size


SERVER_ARG_DEFAULTS: dict[str, Any] = {
    "tokenizer_path": None,
    "quantization": None,
    "chunked_prefill_size": 8192,
    "page_size": 1,
    "schedule_policy": "fcfs",
    "attention_backend": None,
    "speculative_algorithm": None,
    "disable_radix_cache": False,
    "hicache_ratio": 2.0,
    "trust_remote_code": False,
    "random_seed": 1234,
}


def server_args(cfg: StandinConfig) -> dict[str, Any]:
    args = {
        k: v
        for k, v in asdict(cfg).items()
        if k not in ("version", "starting_polls", "old_api", "states_have_capacity",
                     "rank_jitter", "seen")
    }
    args["served_model_name"] = cfg.served_model_name or cfg.model_path
    args["tokenizer_path"] = cfg.model_path
    return {**SERVER_ARG_DEFAULTS, **args}


def server_info(cfg: StandinConfig) -> dict[str, Any]:
    states = []
    for rank in range(cfg.dp_size):
        memory: dict[str, Any] = {"weight": 61.8, "kvcache": 14.2, "graph": 1.1}
        if cfg.states_have_capacity:
            memory["token_capacity"] = cfg.rank_capacity(rank)
        states.append({"last_gen_throughput": 0.0, "memory_usage": memory, "dp_rank": rank})
    return {
        **server_args(cfg),
        "max_total_num_tokens": cfg.rank_capacity(0),
        "max_req_input_len": (cfg.context_length or 131072) - 1,
        "internal_states": states,
        "version": cfg.version,
    }


def loads(cfg: StandinConfig) -> dict[str, Any]:
    ranks = [
        {
            "dp_rank": rank,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_used_tokens": 0,
            "max_total_num_tokens": cfg.rank_capacity(rank),
            "token_usage": 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
            "max_running_requests": cfg.rank_max_running(),
        }
        for rank in range(cfg.dp_size)
    ]
    # Listed in reverse: a client must order by dp_rank, not by position.
    return {
        "timestamp": time.time(),
        "version": cfg.version,
        "dp_rank_count": cfg.dp_size,
        "loads": ranks[::-1],
        "aggregate": {"total_running_reqs": 0, "total_waiting_reqs": 0, "avg_token_usage": 0.0},
    }


def make_app(cfg: StandinConfig) -> web.Application:
    polls = [0]

    def starting() -> bool:
        polls[0] += 1
        return polls[0] <= cfg.starting_polls

    async def health(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        return web.Response(status=503 if starting() else 200)

    async def info(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        if cfg.old_api and request.path == "/server_info":
            raise web.HTTPNotFound()
        return web.json_response(server_info(cfg))

    async def v1_loads(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        if cfg.old_api:
            raise web.HTTPNotFound()
        return web.json_response(loads(cfg))

    async def models(request: web.Request) -> web.Response:
        name = cfg.served_model_name or cfg.model_path
        return web.json_response(
            {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "sglang",
                                         "root": cfg.model_path,
                                         "max_model_len": cfg.context_length or 131072}]}
        )

    async def chat(request: web.Request) -> web.Response:
        cfg.seen.append(request.path)
        body = await request.json()
        if starting():
            return web.json_response({"object": "error", "message": "starting"}, status=503)
        return web.json_response(
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "x",
                                    "reasoning_content": None, "tool_calls": None},
                        "logprobs": None,
                        "finish_reason": "length",
                        "matched_stop": None,
                    }
                ],
                "usage": {"prompt_tokens": 9, "total_tokens": 10, "completion_tokens": 1},
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        if not cfg.enable_metrics:
            raise web.HTTPNotFound()
        name = cfg.served_model_name or cfg.model_path
        lines = [
            "# HELP sglang:max_total_num_tokens Maximum total number of tokens",
            "# TYPE sglang:max_total_num_tokens gauge",
            *(f'sglang:max_total_num_tokens{{dp_rank="{r}",model_name="{name}"}} '
              f"{float(cfg.rank_capacity(r))}" for r in range(cfg.dp_size)),
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            *(f'sglang:num_running_reqs{{dp_rank="{r}",model_name="{name}"}} 0.0'
              for r in range(cfg.dp_size)),
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/server_info", info)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/v1/loads", v1_loads)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def start_standin(cfg: StandinConfig) -> tuple[web.AppRunner, str]:
    """Serve `cfg` on 127.0.0.1, port 0; returns the runner (to clean up) and the URL."""
    runner = web.AppRunner(make_app(cfg))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def parse_launch_argv(argv: list[str]) -> StandinConfig:
    """SGLang's launch flags, as `python -m sglang.launch_server` receives them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reasoning-parser")
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--context-length", type=int)
    p.add_argument("--enable-metrics", action="store_true")
    flags = [a for a in argv if a not in ("-m", "sglang.launch_server")]
    args, _unknown = p.parse_known_args(flags)
    return StandinConfig(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention,
        mem_fraction_static=args.mem_fraction_static,
        # A server that ignores what it was asked for: what the after-start check is for.
        kv_cache_dtype=os.environ.get("STANDIN_KV_DTYPE", args.kv_cache_dtype),
        dtype=args.dtype,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_size=args.hicache_size,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        reasoning_parser=args.reasoning_parser,
        enable_metrics=args.enable_metrics,
        host=args.host,
        port=args.port,
        starting_polls=int(os.environ.get("STANDIN_STARTING_POLLS", "0")),
    )


def main(argv: list[str]) -> None:
    """Run as the launched server process. STANDIN_MODE: serve (default), crash, silent,
    ignore-term. STANDIN_CHILD=1 forks a child into the group, like SGLang's schedulers;
    STANDIN_STARTING_POLLS answers 503 that many times first."""
    mode = os.environ.get("STANDIN_MODE", "serve")
    print("standin argv:", " ".join(argv), flush=True)
    if mode == "crash":
        print("RuntimeError: CUDA is not available (stand-in crash)", flush=True)
        sys.exit(3)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("STANDIN_CHILD") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child pid:", child.pid, flush=True)
    if mode == "silent":
        time.sleep(600)
    cfg = parse_launch_argv(argv)

    async def serve() -> None:
        runner = web.AppRunner(make_app(cfg), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        print(f"The server is fired up and ready to roll! port {cfg.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())

"""Client CPU per streamed chunk: draftgen's ChatClient against the alternatives.

A fake OpenAI-compatible server runs in a subprocess (so its CPU is not charged to the
client) and streams pre-made vLLM-shaped SSE chunks as fast as it can: N concurrent
streams × M content chunks each, then a finish chunk, a usage chunk and [DONE]. The client
process measures, per client:
  chunks/s     content chunks received per wall second (bounded by the server too)
  cpu s / 1M   client-process CPU seconds per million chunks: the number that matters,
               since the server in a real run is on other machines
  server cpu   the fake server's CPU share over the run (near 100%: it was the bottleneck)

Clients: `draftgen` (ChatClient), `aiohttp-raw` (same transport, bytes read and dropped:
the floor any aiohttp-based parser sits on), and `openai` (AsyncOpenAI with base_url,
stream=True) when the `openai` package is importable.

Usage: python bench/client_overhead.py [--streams 256] [--chunks 400] [--events-per-write 1]
       [--repeat 3] [--clients draftgen,aiohttp-raw,openai]

Results, `python bench/client_overhead.py` (defaults), 2-CPU dev machine shared with other
work, so chunks/s moves between runs; cpu s / 1M chunks is the figure to compare:

    python 3.11.7, aiohttp 3.14.5, openai 3.57.0, 2 CPUs; server in a subprocess;
    256 streams × 400 chunks, 1 event(s) per server write; median of 3
    client         chunks/s  cpu s / 1M chunks  server cpu
    draftgen        189,617               3.14        40%
    aiohttp-raw     245,391               2.32        58%
    openai            6,577             115.99         2%

(an earlier run on the same machine: draftgen 2.77, aiohttp-raw 2.11, openai 103.84.)
Parsing costs draftgen about 0.7-0.8 µs per chunk above the bare transport; the openai
SDK costs ~35x more CPU per chunk, enough to saturate one core near 10k chunks/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

TOKEN = " word"
MODEL = "bench-model"


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    # The fields vLLM sends with every chunk, so parse cost is realistic.
    obj = {
        "id": "chatcmpl-4f1b2c3d4e5f60718293a4b5c6d7e8f9",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _body_writes(chunks: int, per_write: int) -> list[bytes]:
    events = [_event({"role": "assistant", "content": ""})]
    events += [_event({"content": TOKEN})] * chunks
    events.append(_event({}, finish="length"))
    usage = {"prompt_tokens": 10, "completion_tokens": chunks, "total_tokens": 10 + chunks}
    events.append(
        b"data: "
        + orjson.dumps(
            {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        )
        + b"\n\n"
    )
    events.append(b"data: [DONE]\n\n")
    return [b"".join(events[i : i + per_write]) for i in range(0, len(events), per_write)]


# --- the server (subprocess) -----------------------------------------------------------


def serve(chunks: int, per_write: int) -> None:
    writes = _body_writes(chunks, per_write)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        for data in writes:
            await response.write(data)
        await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the clients -----------------------------------------------------------------------

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
Runner = Callable[[int], Awaitable[None]]


async def run_draftgen(url: str, streams: int, expect: int) -> Callable[[int], Awaitable[None]]:
    from draftgen.client import ChatClient

    client = ChatClient()
    await client.__aenter__()

    async def one() -> None:
        result = await client.chat(url, BODY)
        assert len(result.content) == expect, len(result.content)

    async def batch(n: int) -> None:
        if n < 0:
            await client.__aexit__(None, None, None)
            return
        await asyncio.gather(*(one() for _ in range(n)))

    return batch


async def run_aiohttp_raw(url: str, streams: int, expect: int) -> Callable[[int], Awaitable[None]]:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=300),
    )
    data = orjson.dumps({**BODY, "stream": True})

    async def one() -> None:
        async with session.post(url + "/v1/chat/completions", data=data) as response:
            size = 0
            while chunk := await response.content.readany():
                size += len(chunk)
            assert size > expect

    async def batch(n: int) -> None:
        if n < 0:
            await session.close()
            return
        await asyncio.gather(*(one() for _ in range(n)))

    return batch


async def run_openai(url: str, streams: int, expect: int) -> Callable[[int], Awaitable[None]]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)

    async def one() -> None:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        assert len("".join(parts)) == expect

    async def batch(n: int) -> None:
        if n < 0:
            await client.close()
            return
        await asyncio.gather(*(one() for _ in range(n)))

    return batch


CLIENTS: dict[str, Callable[[str, int, int], Awaitable[Callable[[int], Awaitable[None]]]]] = {
    "draftgen": run_draftgen,
    "aiohttp-raw": run_aiohttp_raw,
    "openai": run_openai,
}


async def measure(
    name: str, url: str, streams: int, chunks: int, repeat: int, server_pid: int
) -> dict[str, float]:
    batch = await CLIENTS[name](url, streams, chunks * len(TOKEN))
    await batch(min(streams, 16))  # warm-up: imports, first connections
    cpu_per_m: list[float] = []
    rates: list[float] = []
    server_share: list[float] = []
    for _ in range(repeat):
        wall0, cpu0, srv0 = time.perf_counter(), time.process_time(), _proc_cpu_s(server_pid)
        await batch(streams)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        srv = _proc_cpu_s(server_pid) - srv0
        total = streams * chunks
        rates.append(total / wall)
        cpu_per_m.append(cpu / total * 1e6)
        server_share.append(srv / wall)
    await batch(-1)
    return {
        "chunks_per_s": statistics.median(rates),
        "cpu_s_per_m": statistics.median(cpu_per_m),
        "server_cpu": statistics.median(server_share),
    }


async def bench(args: argparse.Namespace) -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "--chunks",
            str(args.chunks),
            "--events-per-write",
            str(args.events_per_write),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        names = [n for n in args.clients.split(",") if n]
        versions = f"aiohttp {aiohttp.__version__}"
        if "openai" in names:
            try:
                import openai
            except ImportError:
                print("openai is not importable: skipped")
                names.remove("openai")
            else:
                versions += f", openai {openai.__version__}"
        rows = [
            (n, await measure(n, url, args.streams, args.chunks, args.repeat, server.pid))
            for n in names
        ]
    finally:
        server.terminate()
        server.wait()

    print(
        f"python {platform.python_version()}, {versions}, "
        f"{os.cpu_count()} CPUs; server in a subprocess; {args.streams} streams × "
        f"{args.chunks} chunks, {args.events_per_write} event(s) per server write; "
        f"median of {args.repeat}"
    )
    print(f"{'client':<12} {'chunks/s':>10} {'cpu s / 1M chunks':>18} {'server cpu':>11}")
    for name, row in rows:
        print(
            f"{name:<12} {row['chunks_per_s']:>10,.0f} {row['cpu_s_per_m']:>18.2f} "
            f"{row['server_cpu']:>10.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=400)
    parser.add_argument("--events-per-write", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clients", default="draftgen,aiohttp-raw,openai")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.chunks, args.events_per_write)
    else:
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()

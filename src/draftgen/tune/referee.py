"""The A/B probe against a recorded reference: the reference is asked once, candidates later.

`draftgen probe` asks two live servers. A tune starts one server at a time (two engines on
one machine share its memory and cores, and the reference would have to stay up through
every candidate), so the reference's side is recorded after its launch — each prompt's
token ids as its chat template renders them, its greedy continuation, and its teacher-forced
top-k at every position of it — and written to the tune directory. Each candidate is then
scored on those same ids and continues them greedily, and `probe.drift` compares and judges
exactly as `draftgen probe` does. Every candidate meets the same reference answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from draftgen.probe.drift import ProbeResult, ProbeThresholds, compare_prompt, summarise
from draftgen.probe.servers import Http, Position, ProbeError, connect
from draftgen.sample import Message
from draftgen.store.atomic import write_atomic

_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RecordedReference:
    url: str
    engine: str
    model: str | None
    max_tokens: int
    top_k: int
    prompts: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[Position, ...], ...]

    def to_json(self) -> bytes:
        return orjson.dumps({
            "url": self.url, "engine": self.engine, "model": self.model,
            "max_tokens": self.max_tokens, "top_k": self.top_k,
            "prompts": self.prompts, "outputs": self.outputs,
            "positions": [[[p.token, p.logprob, p.top1, {str(k): v for k, v in p.top.items()}]
                           for p in row] for row in self.positions],
        })

    @classmethod
    def from_json(cls, raw: bytes) -> RecordedReference:
        d: dict[str, Any] = orjson.loads(raw)
        return cls(
            url=d["url"], engine=d["engine"], model=d["model"], max_tokens=d["max_tokens"],
            top_k=d["top_k"], prompts=tuple(tuple(p) for p in d["prompts"]),
            outputs=tuple(tuple(o) for o in d["outputs"]),
            positions=tuple(tuple(Position(int(t), float(lp), int(t1),
                                           {int(k): float(v) for k, v in top.items()})
                                  for t, lp, t1, top in row) for row in d["positions"]))

    def save(self, path: Path) -> None:
        write_atomic(path, self.to_json())


def load_reference(path: Path) -> RecordedReference | None:
    """The recorded reference, or None when there is none (or it cannot be read)."""
    try:
        return RecordedReference.from_json(path.read_bytes())
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


async def _each(count: int, work: Any, concurrency: int) -> None:
    todo = iter(range(count))

    async def worker() -> None:
        for i in todo:
            await work(i)

    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(concurrency, count)):
                tg.create_task(worker())
    except ExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None


async def record_reference(url: str, prompts: Sequence[Sequence[Message]], *, model: str | None,
                           max_tokens: int, top_k: int, api_key: str | None = None,
                           concurrency: int = 8) -> RecordedReference:
    """Render, continue greedily and score every prompt on the reference server."""
    if not prompts:
        raise ProbeError("no prompts to probe with")
    n = len(prompts)
    ids: list[list[int]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    scored: list[list[Position]] = [[] for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as s:
        server = await connect(Http(s, api_key), url, model)

        async def one(i: int) -> None:
            ids[i] = await server.render(prompts[i])
            outs[i] = await server.greedy(ids[i], max_tokens)
            scored[i] = await server.score(ids[i], outs[i], top_k)

        await _each(n, one, concurrency)
    return RecordedReference(url, server.kind, server.model, max_tokens, top_k,
                             tuple(map(tuple, ids)), tuple(map(tuple, outs)),
                             tuple(map(tuple, scored)))


async def probe_against(reference: RecordedReference, url: str, *,
                        thresholds: ProbeThresholds, api_key: str | None = None,
                        concurrency: int = 8) -> ProbeResult:
    """Score and continue the reference's prompts on `url`, and judge the drift."""
    n = len(reference.prompts)
    results: list[Any] = [None] * n
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as s:
        server = await connect(Http(s, api_key), url, reference.model)

        async def one(i: int) -> None:
            prompt, ref_out = list(reference.prompts[i]), list(reference.outputs[i])
            positions = await server.score(prompt, ref_out, reference.top_k)
            greedy = await server.greedy(prompt, reference.max_tokens)
            results[i] = compare_prompt(i, len(prompt), ref_out, greedy,
                                        list(reference.positions[i]), positions)

        await _each(n, one, concurrency)
    return summarise(reference.url, url, (reference.engine, server.kind), reference.model,
                     reference.max_tokens, reference.top_k, thresholds, tuple(results))


def probe_summary(result: ProbeResult) -> dict[str, Any]:
    """What a trial records of a probe."""
    return {
        "mean_kl": result.mean_kl, "p95_kl": result.p95_kl,
        "top1_agreement": result.top1_agreement, "exact_match_rate": result.exact_match_rate,
        "positions": result.positions, "passed": result.passed,
        "failures": list(result.failures),
    }


__all__ = ["RecordedReference", "load_reference", "probe_against",
           "probe_summary", "record_reference"]

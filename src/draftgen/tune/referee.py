"""The A/B probe against a recorded reference: the reference is asked once, candidates later.

`draftgen probe` asks two live servers. A tune starts one server at a time (two engines on
one machine share its memory and cores, and the reference would have to stay up through
every candidate), so the reference's side is recorded after its launch — each prompt's
token ids as its chat template renders them, its greedy continuation, its teacher-forced
top-k at every position of it, its own decode-step top-k, the tokens of a second decode
beside the first (its batch-to-batch agreement), and its scores read through the prefix
cache — and written to the tune directory. Each candidate is then scored on those same ids
(fresh and through its cache), continues them greedily and decodes them with its top-k;
`probe.drift` judges the prefill path as `draftgen probe` does, and `probe.gate` the decode
path (where the candidate's tokens still follow the reference's, its decode step against the
reference's score of that same context) and the cache-read path, each against the
reference's own noise — or, where the candidate's decode returns no logprobs (speculative
decoding on some engines), the greedy path: its tokens against the recording's, the floor
the recording's two decodes. Every candidate meets the same reference answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from draftgen.client.http import open_session
from draftgen.engines.registry import scoring_server as connect
from draftgen.engines.scoring import Http, Position, ProbeError
from draftgen.probe.drift import ProbeResult, ProbeThresholds, compare_prompt, summarise
from draftgen.probe.gate import (
    GateSettings,
    PromptPaths,
    against_recording,
    cached_scores,
    compare_paths,
    decode_or_none,
    greedy_path,
    judge,
)
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
    # Its decode step's own top-k, and its scores through the prefix cache (empty in a
    # recording made before the gate: then only the prefill path is judged).
    decodes: tuple[tuple[Position, ...], ...] = ()
    cached: tuple[tuple[Position, ...], ...] = ()
    # The tokens of its second decode, made beside the first: the greedy path's floor
    # (empty in a recording made before that path).
    again: tuple[tuple[int, ...], ...] = ()

    def to_json(self) -> bytes:
        return orjson.dumps({
            "url": self.url, "engine": self.engine, "model": self.model,
            "max_tokens": self.max_tokens, "top_k": self.top_k,
            "prompts": self.prompts, "outputs": self.outputs,
            "positions": _rows(self.positions), "decodes": _rows(self.decodes),
            "cached": _rows(self.cached), "again": self.again,
        })

    @classmethod
    def from_json(cls, raw: bytes) -> RecordedReference:
        d: dict[str, Any] = orjson.loads(raw)
        return cls(
            url=d["url"], engine=d["engine"], model=d["model"], max_tokens=d["max_tokens"],
            top_k=d["top_k"], prompts=tuple(tuple(p) for p in d["prompts"]),
            outputs=tuple(tuple(o) for o in d["outputs"]),
            positions=_read_rows(d["positions"]), decodes=_read_rows(d.get("decodes") or []),
            cached=_read_rows(d.get("cached") or []),
            again=tuple(tuple(a) for a in d.get("again") or []))

    def save(self, path: Path) -> None:
        write_atomic(path, self.to_json())


def _rows(rows: tuple[tuple[Position, ...], ...]) -> list[list[list[Any]]]:
    return [[[p.token, p.logprob, p.top1, {str(k): v for k, v in p.top.items()}] for p in row]
            for row in rows]


def _read_rows(rows: list[Any]) -> tuple[tuple[Position, ...], ...]:
    return tuple(tuple(Position(int(t), float(lp), int(t1),
                                {int(k): float(v) for k, v in top.items()})
                       for t, lp, t1, top in row) for row in rows)


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
    decoded: list[list[Position]] = [[] for _ in range(n)]
    cached: list[list[Position]] = [[] for _ in range(n)]
    again: list[list[Position]] = [[] for _ in range(n)]
    async with open_session(timeout_s=_TIMEOUT_S) as s:
        server = await connect(Http(s, api_key), url, model)

        async def one(i: int) -> None:
            ids[i] = await server.render(prompts[i])
            decoded[i], again[i] = await asyncio.gather(
                server.decode(ids[i], max_tokens, top_k),
                server.decode(ids[i], max_tokens, top_k))
            outs[i] = [p.token for p in decoded[i]]
            scored[i] = await server.score(ids[i], outs[i], top_k)
            cached[i] = await cached_scores(server, ids[i], outs[i], top_k)

        await _each(n, one, concurrency)
    return RecordedReference(url, server.kind, server.model, max_tokens, top_k,
                             tuple(map(tuple, ids)), tuple(map(tuple, outs)),
                             tuple(map(tuple, scored)), tuple(map(tuple, decoded)),
                             tuple(map(tuple, cached)),
                             tuple(tuple(p.token for p in row) for row in again))


async def probe_against(reference: RecordedReference, url: str, *,
                        thresholds: ProbeThresholds, api_key: str | None = None,
                        concurrency: int = 8, gate: GateSettings | None = None
                        ) -> ProbeResult:
    """Score and continue the reference's prompts on `url`, and judge the drift: the
    prefill path always, the decode and cache-read paths where `gate` is given and the
    recording has them (the greedy path instead, where `url` decodes without logprobs)."""
    n = len(reference.prompts)
    results: list[Any] = [None] * n
    paths: list[PromptPaths | None] = [None] * n
    judged = gate is not None and len(reference.decodes) == n
    async with open_session(timeout_s=_TIMEOUT_S) as s:
        server = await connect(Http(s, api_key), url, reference.model)

        async def one(i: int) -> None:
            prompt, ref_out = list(reference.prompts[i]), list(reference.outputs[i])
            positions = await server.score(prompt, ref_out, reference.top_k)
            decoded = await decode_or_none(server, prompt, reference.max_tokens,
                                           reference.top_k) if judged else None
            if decoded is None:
                greedy = await server.greedy(prompt, reference.max_tokens)
                if judged:
                    paths[i] = greedy_path(ref_out, greedy, _again(reference, i))
            else:
                greedy = [p.token for p in decoded]
                values = {"decode": against_recording(reference.positions[i],
                                                      reference.decodes[i], decoded)}
                if gate is not None and gate.cache_read and len(reference.cached) == n \
                        and len(ref_out) >= 4:
                    mine = await cached_scores(server, prompt, ref_out, reference.top_k)
                    half = len(ref_out) // 2
                    theirs = reference.cached[i]
                    values["cache read"] = compare_paths(
                        theirs[half:], mine[half:], reference.positions[i][half:],
                        theirs[half:])
                paths[i] = PromptPaths(values, not reference.again
                                       or list(reference.again[i]) == ref_out)
            results[i] = compare_prompt(i, len(prompt), ref_out, greedy,
                                        list(reference.positions[i]), positions)

        await _each(n, one, concurrency)
    result = summarise(reference.url, url, (reference.engine, server.kind), reference.model,
                       reference.max_tokens, reference.top_k, thresholds, tuple(results))
    if not judged or gate is None:
        return result
    return replace(result, gate=judge([p for p in paths if p is not None], gate,
                                      reference.max_tokens))


def _again(reference: RecordedReference, i: int) -> list[int]:
    if len(reference.again) != len(reference.prompts):
        raise ProbeError("the candidate's decode returns no logprobs, and the recorded "
                         "reference has no second decode to judge its greedy tokens against "
                         "(recorded before that path): delete reference_probe.json to "
                         "record it again")
    return list(reference.again[i])


def probe_summary(result: ProbeResult) -> dict[str, Any]:
    """What a trial records of a probe."""
    return {
        "mean_kl": result.mean_kl, "p95_kl": result.p95_kl,
        "top1_agreement": result.top1_agreement, "exact_match_rate": result.exact_match_rate,
        "positions": result.positions, "passed": result.passed,
        "failures": list(result.failures),
        "gate": result.gate.to_dict() if result.gate is not None else None,
    }


__all__ = ["RecordedReference", "load_reference", "probe_against",
           "probe_summary", "record_reference"]

"""How fast a job will run: a capacity model of KV-bound batched decoding.

With long outputs the KV cache, not arithmetic, bounds throughput. A running request holds
its prompt plus every token generated so far in the cache, so over its life it holds on
average `prompt + output/2` tokens, and an engine can keep only about
`kv_tokens / footprint` requests decoding at once. Requests live in proportion to their
output length, so the footprint that matters is the duration-weighted mean
`Σ o·(p + o/2) / Σ o`: a few very long answers count for much more than their share of
samples. The decode speed of an engine depends on how many requests share a step; it is
given as measured points `(running requests, output tok/s)` (see `calibrate.py`), with step
time interpolated linearly between them and extrapolated from the last two.

`predict` answers with two figures:

- a **steady state**: running = min(KV-limited running, client concurrency per server,
  the engine's own limit), and the output tok/s at that batch, with which bound applies;
- a **simulation** of the whole plan, which is what duration and ETA come from. Each
  server gets every n-th sample of the plan (data-parallel replicas share the work evenly)
  and 1/n of each partition's concurrency. Output lengths are drawn, seeded, from the
  measured lengths of the same category and partition (falling back to the category, the
  partition, all measurements, then half of max_tokens), capped at max_tokens. The client
  keeps each partition's concurrency in flight and the engine admits, decodes and preempts
  as vLLM does (`simulate.py`). It sees what an average cannot: the tail at the end of a
  run, when the last long requests decode at a small batch, and a small partition that
  finishes early or late.

Assumptions, each a source of error to keep in mind:

- Decode step time depends only on the batch size, as measured; attention cost growing with
  context is folded into the measured points, so measure with lengths like the job's.
- Prefill is a serial cost of `prompt_tokens / prefill_tok_s` seconds on admission (and on
  re-admission after preemption) when a prefill speed is known, otherwise free.
- KV is counted in tokens; paged caches lose on average half a block per request, added to
  each request's footprint. Prefix caching is ignored (it only helps).
- Output lengths are independent of each other and of prompt length within a (category,
  partition); lengths measured under a smaller max_tokens are censored there.
- Multi-turn samples count as one request with all their output tokens.
- Servers are identical and never down; the client adds no delay.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from draftgen.simulate import Totals, simulate

# Default decode shape when nothing was measured: step time flat until about this batch,
# then growing linearly (memory-bound decode turning compute-bound).
DEFAULT_HALF_BATCH = 64.0
DEFAULT_SINGLE_STREAM_TOK_S = 60.0

Bound = Literal["kv", "concurrency", "max_running"]


@dataclass(frozen=True, slots=True)
class DecodeSpeed:
    """Output tokens/s of one server as a function of the number of running requests.

    `points` are `(running, tok/s)` pairs; step time (`running / tok/s`) is interpolated
    linearly between them, held flat below the first, and extrapolated beyond the last
    along the last segment (never decreasing). One point is extended with the default shape.
    """

    points: tuple[tuple[float, float], ...]
    prefill_tok_s: float | None = None
    source: str = "measured"

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("DecodeSpeed needs at least one (running, tok/s) point")
        for b, r in self.points:
            if b <= 0 or r <= 0:
                raise ValueError(f"speed points must be positive, got ({b}, {r})")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    @classmethod
    def assumed(cls, single_stream_tok_s: float = DEFAULT_SINGLE_STREAM_TOK_S,
                half_batch: float = DEFAULT_HALF_BATCH) -> DecodeSpeed:
        """A default shape when nothing is measured: the answer is only as good as the guess."""
        return cls(_shape_points(1.0, single_stream_tok_s, half_batch), None, "assumed")

    def step_s(self, running: float) -> float:
        """Seconds per engine step (one token for each running request)."""
        pts = self.points
        steps = [b / r for b, r in pts]
        if len(pts) == 1:
            b1 = pts[0][0]
            scale = steps[0] / (1 + (b1 - 1) / DEFAULT_HALF_BATCH)
            return steps[0] if running <= b1 else scale * (1 + (running - 1) / DEFAULT_HALF_BATCH)
        if running <= pts[0][0]:
            return steps[0]
        for i in range(1, len(pts)):
            if running <= pts[i][0]:
                b0, b1 = pts[i - 1][0], pts[i][0]
                return steps[i - 1] + (steps[i] - steps[i - 1]) * (running - b0) / (b1 - b0)
        slope = max(0.0, (steps[-1] - steps[-2]) / (pts[-1][0] - pts[-2][0]))
        return steps[-1] + slope * (running - pts[-1][0])

    def tok_s(self, running: float) -> float:
        return running / self.step_s(running) if running > 0 else 0.0


def _shape_points(b1: float, tok_s: float, half: float) -> tuple[tuple[float, float], ...]:
    step1 = b1 / tok_s
    return tuple((b, b / (step1 * (1 + (b - b1) / half))) for b in (b1, 2 * half, 8 * half))


@dataclass(frozen=True, slots=True)
class ServerCapacity:
    """What one server (all alike) can hold and how fast it decodes."""

    kv_tokens: int
    speed: DecodeSpeed
    servers: int = 1
    # Tokens per KV page (vLLM GPU 16, vLLM CPU 128, SGLang 1): half a page is lost per request.
    block_size: int = 1
    # The engine's own cap on running requests (max_num_seqs, max_running_requests).
    max_running: int | None = None

    def __post_init__(self) -> None:
        if self.kv_tokens <= 0 or self.servers <= 0 or self.block_size <= 0:
            raise ValueError("kv_tokens, servers and block_size must be positive")


class _PlannedLike(Protocol):
    @property
    def category(self) -> str: ...
    @property
    def partition(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Workload:
    """The samples to run, in plan order (one column per field), and what is known of them.

    `output_samples` are measured output lengths per (category, partition); `concurrency`
    is each partition's client-side limit on requests in flight, over all servers.
    """

    categories: tuple[str, ...]
    partitions: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    concurrency: Mapping[str, int]
    output_samples: Mapping[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    # Prior for groups nothing was measured for: this fraction of max_tokens.
    prior_output_fraction: float = 0.5
    # Exact output lengths per sample when known (a finished run replayed); else drawn.
    known_outputs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.categories)
        if not (len(self.partitions) == len(self.prompt_tokens) == len(self.max_tokens) == n):
            raise ValueError("Workload columns must have one entry per sample")
        if self.known_outputs is not None and len(self.known_outputs) != n:
            raise ValueError("known_outputs must have one entry per sample")
        missing = set(self.partitions) - set(self.concurrency)
        if missing:
            raise ValueError(f"no concurrency for partition(s) {sorted(missing)}")

    @classmethod
    def from_samples(cls, samples: Iterable[_PlannedLike], concurrency: Mapping[str, int],
                     output_samples: Mapping[tuple[str, str], Sequence[int]] | None = None,
                     ) -> Workload:
        """From `Sample`s (or anything with category, partition, prompt_tokens, max_tokens)."""
        rows = [(s.category, s.partition, s.prompt_tokens, s.max_tokens) for s in samples]
        return cls._build(rows, concurrency, output_samples)

    @classmethod
    def from_plan_rows(cls, rows: Iterable[Mapping[str, Any]], concurrency: Mapping[str, int],
                       output_samples: Mapping[tuple[str, str], Sequence[int]] | None = None,
                       ) -> Workload:
        """From the rows of a run's `plan.jsonl`."""
        cols = [(r["category"], r["partition"], int(r.get("prompt_tokens") or 0),
                 int(r["max_tokens"])) for r in rows]
        return cls._build(cols, concurrency, output_samples)

    @classmethod
    def _build(cls, rows: list[tuple[str, str, int, int]], concurrency: Mapping[str, int],
               output_samples: Mapping[tuple[str, str], Sequence[int]] | None) -> Workload:
        cats, parts, prompts, maxes = (tuple(c) for c in zip(*rows, strict=True)) if rows \
            else ((), (), (), ())
        outs = {k: tuple(int(x) for x in v) for k, v in (output_samples or {}).items() if v}
        return cls(cats, parts, prompts, maxes, dict(concurrency), outs)

    def __len__(self) -> int:
        return len(self.categories)

    def take(self, per_category: Mapping[str, int]) -> Workload:
        """The first n samples of each named category (plan order); others are kept whole.

        A category cap keeps a prefix of the category's shuffled prompts, so this is exactly
        the plan the capped job would make.
        """
        seen: dict[str, int] = {}
        keep: list[int] = []
        for i, c in enumerate(self.categories):
            seen[c] = seen.get(c, 0) + 1
            if c not in per_category or seen[c] <= per_category[c]:
                keep.append(i)
        known = self.known_outputs
        return Workload(
            tuple(self.categories[i] for i in keep), tuple(self.partitions[i] for i in keep),
            tuple(self.prompt_tokens[i] for i in keep), tuple(self.max_tokens[i] for i in keep),
            self.concurrency, self.output_samples, self.prior_output_fraction,
            tuple(known[i] for i in keep) if known is not None else None)

    def draw_outputs(self, seed: int) -> list[int]:
        """One output length per sample; seeded per category, so a capped plan draws the
        same lengths for the samples it keeps."""
        if self.known_outputs is not None:
            return [max(1, min(n, m)) for n, m in zip(self.known_outputs, self.max_tokens,
                                                      strict=True)]
        pools = _output_pools(self.output_samples)
        rngs: dict[str, random.Random] = {}
        out: list[int] = []
        for c, p, m in zip(self.categories, self.partitions, self.max_tokens, strict=True):
            rng = rngs.get(c)
            if rng is None:
                rng = rngs[c] = random.Random(f"{seed}:{c}")
            pool = pools.get((c, p)) or pools.get((c, "")) or pools.get(("", p)) \
                or pools.get(("", ""))
            n = pool[rng.randrange(len(pool))] if pool else round(m * self.prior_output_fraction)
            out.append(max(1, min(n, m)))
        return out


def _output_pools(samples: Mapping[tuple[str, str], tuple[int, ...]],
                  ) -> dict[tuple[str, str], tuple[int, ...]]:
    """Exact groups plus pooled fallbacks keyed with "" for 'any'."""
    pools: dict[tuple[str, str], list[int]] = {}
    for (c, p), v in samples.items():
        for key in ((c, p), (c, ""), ("", p), ("", "")):
            pools.setdefault(key, []).extend(v)
    return {k: tuple(v) for k, v in pools.items()}


@dataclass(frozen=True, slots=True)
class SteadyState:
    """The sustained regime in one line of arithmetic (per server unless said)."""

    footprint_tokens: float  # duration-weighted mean KV tokens a running request holds
    kv_running: float  # kv_tokens / footprint
    concurrency: float  # client in-flight limit per server
    running: float
    bound: Bound
    tok_s: float  # all servers together


@dataclass(frozen=True, slots=True)
class GroupPrediction:
    name: str
    samples: int
    output_tokens: int
    duration_s: float  # from the start until the group's last sample finishes


@dataclass(frozen=True, slots=True)
class Prediction:
    duration_s: float
    samples: int
    output_tokens: int
    prompt_tokens: int
    tok_s: float  # output tokens / duration, all servers
    mean_running: float  # per server, time-averaged over the run
    mean_waiting: float  # queued at the server, per server
    tokens_per_step: float  # output tokens per engine step, comparable to vLLM's metrics
    preemptions: int
    tail_s: float  # from 90% of samples done to the end
    steady: SteadyState
    partitions: tuple[GroupPrediction, ...]
    categories: tuple[GroupPrediction, ...]
    unservable: int  # samples whose prompt alone does not fit a server's cache
    server: ServerCapacity
    workload: Workload
    seed: int
    notes: tuple[str, ...] = ()

    def eta_s(self, partition: str | None = None) -> float:
        if partition is None:
            return self.duration_s
        return next((p.duration_s for p in self.partitions if p.name == partition), 0.0)


def steady_state(server: ServerCapacity, workload: Workload, outputs: Sequence[int]
                 ) -> SteadyState:
    frag = (server.block_size - 1) / 2
    weight = sum(outputs)
    if weight:
        footprint = sum(o * (p + o / 2) for p, o in zip(workload.prompt_tokens, outputs,
                                                        strict=True)) / weight + frag
    else:
        footprint = 1.0
    kv_running = server.kv_tokens / max(footprint, 1.0)
    parts = set(workload.partitions)
    conc = sum(workload.concurrency[p] for p in parts) / server.servers
    limits: list[tuple[float, Bound]] = [(kv_running, "kv"), (conc, "concurrency")]
    if server.max_running is not None:
        limits.append((float(server.max_running), "max_running"))
    running, bound = min(limits, key=lambda x: x[0])
    return SteadyState(footprint, kv_running, conc, running, bound,
                       server.servers * server.speed.tok_s(running))


def predict(server: ServerCapacity, workload: Workload, *, seed: int = 0) -> Prediction:
    """Predict throughput, running requests and durations; see the module docstring."""
    outputs = workload.draw_outputs(seed)
    frag = (server.block_size - 1) / 2
    # A request cannot outgrow one server's whole cache; a prompt that does not fit at all
    # could never run and is left out (the server would reject it).
    room = server.kv_tokens - frag - 1
    fit = [i for i, p in enumerate(workload.prompt_tokens) if p + 1 <= room]
    capped = [min(o, int(room - p)) for p, o in zip(workload.prompt_tokens, outputs,
                                                     strict=True)]
    finish: dict[int, float] = {}
    totals = Totals()
    n = server.servers
    for k in range(n):
        share = fit[k::n]
        if not share:
            continue
        caps = _split_caps(workload.concurrency, n, k)
        simulate(server, workload, share, capped, caps, finish, totals)
    return _summarise(server, workload, seed, outputs, capped, fit, finish, totals)


def _split_caps(concurrency: Mapping[str, int], n: int, k: int) -> dict[str, int]:
    return {p: max(1, c // n + (1 if k < c % n else 0)) for p, c in concurrency.items()}


def _summarise(server: ServerCapacity, w: Workload, seed: int, outputs: list[int],
               capped: list[int], fit: list[int], finish: dict[int, float], totals: Totals,
               ) -> Prediction:
    duration = totals.duration_s
    out_tok = sum(capped[i] for i in fit)
    times = sorted(finish.values())
    tail = duration - times[int(0.9 * (len(times) - 1))] if times else 0.0
    per_server_s = duration * server.servers
    notes: list[str] = []
    if server.speed.source != "measured":
        notes.append(f"decode speed is {server.speed.source}, not measured")
    if not w.output_samples and w.known_outputs is None:
        notes.append(f"no measured output lengths: assumed {w.prior_output_fraction:.0%} of "
                     "max_tokens")
    unservable = len(w) - len(fit)
    if unservable:
        notes.append(f"{unservable} sample(s) have prompts larger than the KV cache")
    return Prediction(
        duration_s=duration,
        samples=len(fit),
        output_tokens=out_tok,
        prompt_tokens=sum(w.prompt_tokens[i] for i in fit),
        tok_s=out_tok / duration if duration > 0 else 0.0,
        mean_running=totals.running_area / per_server_s if per_server_s else 0.0,
        mean_waiting=totals.waiting_area / per_server_s if per_server_s else 0.0,
        tokens_per_step=out_tok / totals.steps if totals.steps else 0.0,
        preemptions=totals.preemptions,
        tail_s=tail,
        steady=steady_state(server, w, capped),
        partitions=_groups(w.partitions, fit, capped, finish),
        categories=_groups(w.categories, fit, capped, finish),
        unservable=unservable,
        server=server,
        workload=w,
        seed=seed,
        notes=tuple(notes),
    )


def _groups(keys: tuple[str, ...], fit: list[int], outputs: list[int],
            finish: dict[int, float]) -> tuple[GroupPrediction, ...]:
    acc: dict[str, list[float]] = {}
    for i in fit:
        a = acc.setdefault(keys[i], [0, 0, 0.0])
        a[0] += 1
        a[1] += outputs[i]
        a[2] = max(a[2], finish.get(i, 0.0))
    return tuple(GroupPrediction(k, int(a[0]), int(a[1]), a[2]) for k, a in acc.items())


__all__ = [
    "DecodeSpeed",
    "GroupPrediction",
    "Prediction",
    "ServerCapacity",
    "SteadyState",
    "Workload",
    "predict",
    "steady_state",
]

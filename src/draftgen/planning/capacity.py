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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from draftgen.planning.simulate import Totals, simulate
from draftgen.planning.workload import Bound, DecodeSpeed, ServerCapacity, Workload


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

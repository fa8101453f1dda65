"""What the capacity model reads: a server's decode speed and KV capacity, and the workload
(the samples and what is known of their output lengths). Apart from `capacity.py` so that
`simulate.py` and the model both import it, and neither the other."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

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

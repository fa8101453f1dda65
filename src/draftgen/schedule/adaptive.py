# long: one policy on one state per server; bench/ sets its constants here by name (adaptive@N=V)
"""Capacity-aware admission: keep the KV cache full, but not over-full, at every moment ahead.

A server takes a new request while the KV tokens that everything in flight on it is
expected to hold stay under its target (`factor × capacity`) at every point of a look-ahead
over the longest max_tokens. A request's expected holding `h` tokens from now is its size
then (prompt + what it has written so far, as counted from the stream, + h, rounded up to
whole KV blocks) times the chance it is still running then, from the output lengths learned
so far (`Lengths`). So a fresh request counts for little now and more later, one near its
likely end counts for what it holds now and soon nothing, and the sum is the KV use the
server will see if nothing new is sent: admitting while its peak fits fills the cache
without over-filling it, whatever the shape of the length distribution.

The factor corrects what the model gets wrong, from what the server reports (`ServerLoad`):
it backs off when preemptions/retractions outrun a small share of the requests finished
(an occasional one is the price of a full cache: it recomputes a prompt, while an idle
slot loses whole decode steps) or when the server queue grows, and pushes up while the
client is the limit (the projection is at its target) yet the server's queue is dry and its
KV usage below target. A short queue at the server is welcome: it refills a slot the moment
one frees. A queue while the cache clearly has room (on consecutive readings, and room
for the largest prompt waiting) means the server's own limit on running requests binds
instead; that limit is learned from the readings and caps what is sent. A queue with the
cache full, or too full for the prompt that waits, is no evidence of one.

Partitions compete by when they would finish: the one whose queue, at its current number
of requests in flight, would take longest to drain, plus the length of its longest answers
(the tail its last request may add), goes first. Both keep flowing, and the partition with
the longer answers drains earlier, so the run does not end in a tail of a few long requests.

When the server's own limit on running requests binds (published by SGLang's /v1/loads,
known from the profile draftgen launched it with, else learned for vLLM), what was sent
beyond limit + a short queue (a first burst before the limit was known) is called back: the
newest requests that have not begun to answer go back to the front of their queue, to be
sent when a slot frees, instead of waiting at the server.

Before that limit is known, and whatever else binds, a server gets at most a few requests
that have not begun to answer (`UNANSWERED`): each first token lets one more go. The first
burst then reaches the server as fast as it prefills, instead of all at once, and what waits
there when its limit is reached is a handful, not the whole overshoot.

Every rule is paced by the clock of the readings (`ServerLoad.at`), not by their count: the
fast start grows the target by a rate per second (its step per `STEP_EVERY_S`, compounded
over the time since the last reading); a back-off settles and cools down for a number of
seconds and is as strong per second of evidence whatever the interval (one reading 2 s
after the last backs off as four 0.5 s apart would); a running limit needs its evidence held
for `SLOT_EVIDENCE_S` over at least two readings, at the most the server ran in the last
`SLOT_WINDOW_S`. The one rule a reading bounds is the push-up: at most one step a reading,
because between two readings the scheduler is blind —
compounded over a 2 s interval it raised the target ×1.22 at once and the server paid for it
in preemptions before the next reading could show them (bench/RESULTS.md, "Poll interval").
So a longer interval recovers from a back-off more slowly, and never overshoots more.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from draftgen.engines.load import ServerLoad
from draftgen.sample import Sample
from draftgen.schedule.base import Flight, PartitionView, Scheduler
from draftgen.schedule.pool import ServerState
from draftgen.schedule.prefixes import SharedPrefixes

FACTOR_MIN = 0.25
FACTOR_MAX = 2.0
# A resumed run starts at the factor the last one ended at, but not under this: a fresh
# run is at x1.0 once lengths are learned, and a run's tail (few requests, long ones)
# backs off for reasons its resume does not share (bench/RESULTS.md, "Poll interval").
RESTORE_FLOOR = 1.0
BACK_OFF_PREEMPT = 0.93
BACK_OFF_QUEUE = 0.95
PUSH_UP = 1.05
KV_TARGET = 0.95
# Preemptions tolerated per request finished since the last change of target (plus a few
# for small counts) before backing off.
PREEMPT_OK = 1.25
PREEMPT_SLACK = 3
QUEUE_OK = 2  # waiting requests at the server that count as "a short queue"
# Requests sent beyond the server's own running limit, when that binds.
SLOT_QUEUE = 1
# A queue is evidence of a running limit only with KV usage at most this, on this many
# readings in a row.
SLOT_EVIDENCE_KV = 0.80
SLOT_READINGS = 2
SLOT_EVIDENCE_S = 0.5
# ... and only at the most the server ran over this many seconds of readings: a server whose
# queue waits for its per-step token budget (long prompts being prefilled) runs a count that
# comes and goes, a limit holds it as a ceiling.
SLOT_WINDOW_S = 10.0
# Requests on a server that have not begun to answer (waiting or in prefill) at most.
UNANSWERED = 16
# Requests finished under the current target before it may rise: what a change does shows
# only once the requests in flight have turned over.
PUSH_EVIDENCE = 4
# Seconds after a back-off before the target may rise again: a preemption burst shows
# over several readings, and pushing straight back up would oscillate.
COOL_DOWN_S = 2.5
# Seconds after a back-off before preemptions count again: what was admitted before it
# still has to finish, so the next reading often shows the same excess.
SETTLE_S = 1.0
# The steps of the fast start and the push-up, and the back-offs, are per this many seconds
# of readings (the bench's poll interval, where they were measured): the fast start and the
# back-offs compound over the time between two readings, the push-up makes one step a
# reading at most.
STEP_EVERY_S = 0.5
# Fast start: until lengths are learned, the target rises by this much every STEP_EVERY_S
# while the server's KV usage reads under FAST_START_KV with no queue and no preemption.
FAST_START_STEP = 1.25
FAST_START_KV = 0.80
STEPS = 16  # look-ahead points over the longest max_tokens
TAIL_QUANTILE = 0.99  # the length a partition's last answers may run to


@dataclass(slots=True)
class _ServerControl:
    capacity: int | None = None
    factor: float = 1.0
    preemptions: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    running: int | None = None
    block: int = 1  # KV allocation granularity in tokens
    backed_off_at: float = float("-inf")  # the reading time of the last back-off
    last_at: float | None = None  # the previous reading's time
    preempted: int = 0  # since the last change of target
    finished: int = 0  # since the last change of target
    projection: list[float] | None = None  # expected KV use ahead; None: to recompute
    max_running: int | None = None  # the server's own limit on running requests, if seen
    known: str | None = None  # where a limit not learned from readings was told (a profile)
    slot_evidence: int = 0  # readings in a row: a queue, room in the cache, `slot_running`
    slot_since: float = 0.0  # the first of them
    slot_running: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (at, running) lately
    fast: bool = True  # fast start: until the first back-off

    @property
    def target(self) -> float | None:
        return None if self.capacity is None else self.capacity * self.factor


@dataclass(frozen=True, slots=True)
class _Reading:
    """One load reading, as the rules of `on_load` weigh it."""

    load: ServerLoad
    new_preempt: int  # preemptions/retractions since the last reading
    growing: bool  # the server queue grew, not from preemptions and not with room to spare
    at_target: bool  # the projection is at its target: the client is the limit
    calm_s: float  # seconds since the last back-off
    steps: float  # the time since the last reading, in STEP_EVERY_S

    @property
    def preempt_steps(self) -> float:
        """Back-offs a preemption excess seen now is worth: one per SETTLE_S +
        STEP_EVERY_S of evidence (the fastest the 0.5 s bench interval backs off), over the
        time it built up since the last back-off or the reading before."""
        evidence = min(self.calm_s, SETTLE_S + self.steps * STEP_EVERY_S)
        return max(1.0, evidence / (SETTLE_S + STEP_EVERY_S))


class AdaptiveScheduler(Scheduler):
    name = "adaptive"

    def __init__(self, log: Callable[[str], None] | None = None, *,
                 initial_factor: float = 1.0) -> None:
        super().__init__(log)
        self._control: dict[str, _ServerControl] = {}
        self._initial_factor = initial_factor
        self._ahead: list[float] = [0.0]
        self._span = 0
        self._candidate: tuple[str, str, list[float]] | None = None  # (sample, url, curve)
        self._prefixes = SharedPrefixes()

    def state(self) -> dict[str, float]:
        """Each server's factor: a resumed run starts where this one ended."""
        return {url: round(c.factor, 4) for url, c in self._control.items()}

    def restore(self, state: Mapping[str, float]) -> None:
        for url, factor in state.items():
            if isinstance(factor, int | float) and FACTOR_MIN <= factor <= FACTOR_MAX:
                c = self.control(url)
                c.factor = max(float(factor), RESTORE_FLOOR)
                c.fast = False  # what the fast start would find is known
                self._log(f"{url}: target ×{c.factor:.2f} of capacity, as the last run ended"
                          + (f" (×{factor:.2f}, raised)" if c.factor > factor else ""))

    def limit_known(self, url: str, limit: int, source: str) -> None:
        """A limit told, not learned (the profile draftgen launched the server with): it
        caps what is sent from the first request, and readings never learn it lower —
        a prefill-bound engine's running count can hold still with a queue for seconds."""
        c = self.control(url)
        c.max_running, c.known = limit, source
        self._log(f"{url}: runs at most {limit} requests at once ({source}); sending at most "
                  f"{limit + SLOT_QUEUE}")

    def control(self, url: str) -> _ServerControl:
        c = self._control.get(url)
        if c is None:
            c = self._control[url] = _ServerControl(factor=self._initial_factor)
        return c

    # --- the projection -------------------------------------------------------------

    def _look_ahead(self, max_tokens: int) -> None:
        """Stretch the look-ahead to cover `max_tokens`; old projections are then stale."""
        if max_tokens > self._span:
            self._span = max_tokens
            self._ahead = [max_tokens * k / STEPS for k in range(STEPS + 1)]
            for c in self._control.values():
                c.projection = None

    def _curve(self, sample: Sample, written: int, earlier: int, block: int,
               skip: int = 0) -> list[float]:
        """Expected KV tokens held by one request at each look-ahead point, less `skip`
        tokens of its prompt that the server holds for others too."""
        alive = self.books.lengths.still_running(sample.category, sample.max_tokens, written,
                                                 self._ahead)
        base = sample.prompt_tokens - skip + earlier + written
        return [-(-(base + h) // block) * block * p if p else 0.0
                for h, p in zip(self._ahead, alive, strict=True)]

    def _new_curve(self, sample: Sample, url: str, block: int) -> list[float]:
        """A request about to be sent: its shared system prompt counts only if the server
        holds it for no request in flight."""
        _, shared = self._prefixes.of(sample)
        extra = shared - self._prefixes.held(url, sample)
        return [x + extra if x else 0.0
                for x in self._curve(sample, 0, 0, block, skip=shared)]

    def _projection(self, url: str) -> list[float]:
        c = self.control(url)
        if c.projection is None:
            # The answers still being written, as at least as long as they are so far.
            written: dict[str, list[int]] = {}
            for f in self.books.flights.values():
                written.setdefault(f.sample.category, []).append(f.earlier + f.written)
            self.books.lengths.running(written)
            total = [0.0] * len(self._ahead)
            shared: dict[str, int] = {}  # held once, whatever number of requests share it
            for f in self.books.flights.values():
                if f.url == url:
                    key, n = self._prefixes.of(f.sample)
                    shared[key] = n
                    for i, x in enumerate(self._curve(f.sample, f.written, f.earlier,
                                                      c.block, skip=n)):
                        total[i] += x
            once = sum(shared.values())
            c.projection = [x + once for x in total]
        return c.projection

    # --- bookkeeping ----------------------------------------------------------------

    def started(self, sample: Sample, server: ServerState) -> Flight:
        self._look_ahead(sample.max_tokens)
        flight = super().started(sample, server)
        c = self.control(server.url)
        if c.projection is not None:
            cand = self._candidate
            curve = (cand[2] if cand is not None and cand[:2] == (sample.id, server.url)
                     else self._new_curve(sample, server.url, c.block))
            c.projection = [a + b for a, b in zip(c.projection, curve, strict=True)]
        self._prefixes.add(server.url, sample)
        self._candidate = None
        return flight

    def ended(self, sample: Sample, server: ServerState, output_tokens: int | None) -> None:
        super().ended(sample, server, output_tokens)
        self._prefixes.remove(server.url, sample)
        if output_tokens is not None:
            self.control(server.url).finished += 1
        # Fewer requests, and the lengths learned have changed: recompute on the next pick.
        for c in self._control.values():
            c.projection = None

    # --- feedback -------------------------------------------------------------------

    def on_load(self, server: ServerState, load: ServerLoad) -> None:
        url = server.url
        c = self.control(url)
        c.projection = None  # requests have written more since the last one
        new_preempt = self._read_counters(url, c, load)
        # A queue while the cache has room: the server's limit on running requests
        # (vLLM --max-num-seqs, SGLang --max-running-requests) binds, not its KV.
        room = load.kv_usage is not None and load.kv_usage < KV_TARGET and not new_preempt
        self._learn_slots(url, c, load, room)
        # Preempted requests wait at the server too; that growth is judged as preemptions.
        growing = (load.waiting is not None and c.waiting is not None and not new_preempt
                   and not room and load.waiting > QUEUE_OK and load.waiting > c.waiting)
        c.waiting, c.kv_usage, c.running = load.waiting, load.kv_usage, load.running
        if c.capacity is None:
            return
        self._end_fast_start(url, c)
        target = c.capacity * c.factor
        at_target = max(self._projection(url)) >= 0.9 * target
        since = STEP_EVERY_S if c.last_at is None else load.at - c.last_at
        c.last_at = load.at
        reading = _Reading(load, new_preempt, growing, at_target,
                           calm_s=load.at - c.backed_off_at, steps=max(since, 0.0) / STEP_EVERY_S)
        # The first rule that applies decides what this reading does to the target.
        for rule in (self._back_off_preempted, self._back_off_queue, self._fast_start,
                     self._push_up):
            if rule(url, c, reading):
                return

    def _read_counters(self, url: str, c: _ServerControl, load: ServerLoad) -> int:
        """Block size, capacity and preemption count from a reading; returns the
        preemptions/retractions since the last one."""
        if load.kv_block_tokens:
            c.block = load.kv_block_tokens
        if load.kv_capacity_tokens and load.kv_capacity_tokens != c.capacity:
            self._log(f"{url}: capacity {load.kv_capacity_tokens:,} KV tokens")
            c.capacity = load.kv_capacity_tokens
        new_preempt = 0
        if load.preemptions_total is not None:
            if c.preemptions is not None:
                new_preempt = max(0, load.preemptions_total - c.preemptions)
            c.preemptions = load.preemptions_total
        c.preempted += new_preempt
        return new_preempt

    def _end_fast_start(self, url: str, c: _ServerControl) -> None:
        if c.fast and self.books.lengths.learned:
            # The fast start corrected a prior that expected every answer to run to
            # max_tokens; the lengths learned now replace it, and so the correction goes.
            c.fast = False
            if c.factor > 1.0:
                self._set(url, c, 1.0,
                          "lengths learned: the fast start's margin is no longer needed")

    def _back_off_preempted(self, url: str, c: _ServerControl, r: _Reading) -> bool:
        """More preemptions than the requests finished allow: back off, unless the last
        back-off has yet to settle; either way the fast start is over."""
        if c.preempted <= PREEMPT_OK * c.finished + PREEMPT_SLACK:
            return False
        if r.calm_s > SETTLE_S:
            self._set(url, c, c.factor * BACK_OFF_PREEMPT ** r.preempt_steps,
                      f"{c.preempted} preemption(s)/retraction(s) for {c.finished} "
                      "request(s) finished")
            c.backed_off_at = r.load.at
        c.fast = False
        return True

    def _back_off_queue(self, url: str, c: _ServerControl, r: _Reading) -> bool:
        """The server queue grows: back off."""
        if not r.growing:
            return False
        self._set(url, c, c.factor * BACK_OFF_QUEUE ** max(1.0, r.steps),
                  f"server queue growing: {r.load.waiting} waiting")
        c.backed_off_at = r.load.at
        c.fast = False
        return True

    def _fast_start(self, url: str, c: _ServerControl, r: _Reading) -> bool:
        """Before lengths are learned, at target with the cache reading well under it:
        step up."""
        load = r.load
        if not (c.fast and r.at_target and not self._unanswered(url)
                and (load.waiting or 0) <= QUEUE_OK and not r.new_preempt
                and load.kv_usage is not None and load.kv_usage < FAST_START_KV):
            return False
        # Before any length is learned the projection expects every answer to run to
        # max_tokens (or to an earlier run's mean) and all at once: the cache reads
        # emptier than that, so trust the reading until the first sign of too much —
        # a reading taken once everything sent has begun to answer, so it shows it.
        self._set(url, c, c.factor * FAST_START_STEP ** r.steps,
                  f"fast start: KV usage {load.kv_usage:.0%}, server queue "
                  f"{load.waiting or 0}, no preemption")
        return True

    def _push_up(self, url: str, c: _ServerControl, r: _Reading) -> bool:
        """Calm, at target, lengths learned, and the server has room: push up."""
        load = r.load
        if not (r.calm_s >= COOL_DOWN_S and r.at_target and c.finished >= PUSH_EVIDENCE
                and self.books.lengths.learned
                and ((load.waiting or 0) == 0
                     or (load.kv_usage is not None and load.kv_usage < KV_TARGET))):
            return False
        usage = "unknown" if load.kv_usage is None else f"{load.kv_usage:.0%}"
        self._set(url, c, c.factor * PUSH_UP ** min(1.0, r.steps),
                  f"at target, server queue {load.waiting or 0}, KV usage {usage}")
        return True

    def _learn_slots(self, url: str, c: _ServerControl, load: ServerLoad, room: bool) -> None:
        """How many requests the server runs at once, when that, not KV, makes it queue.

        A limit the server publishes (SGLang) stands as is, and so does one told
        (`limit_known`) while the server publishes none. Otherwise readings with a
        queue, room in the cache (for the largest prompt waiting too) and the same number
        running, held for SLOT_EVIDENCE_S, set the limit to that number if it is the most
        the server ran in the last SLOT_WINDOW_S; a reading with more running raises it
        (sending limit + SLOT_QUEUE probes for that).
        """
        if load.max_running:
            if load.max_running != c.max_running:
                self._log(f"{url}: runs at most {load.max_running} requests at once "
                          f"(published); sending at most {load.max_running + SLOT_QUEUE}")
            c.max_running = load.max_running
            return
        running, waiting = load.running, load.waiting
        if c.known is not None or running is None or waiting is None:
            return
        c.recent.append((load.at, running))
        while c.recent[0][0] < load.at - SLOT_WINDOW_S:
            c.recent.popleft()
        if c.max_running is not None and running > c.max_running:
            c.max_running, c.slot_evidence = running, 0
            return
        # Evidence of a limit is a queue while the cache is clearly not full (a request
        # waits for blocks long before usage reads 100%), seen on consecutive readings
        # (a queue the engine clears within a step is no limit). A full cache queues too:
        # that is the cache binding, which the KV target handles.
        # Room is room for what waits: a cache of a few long prompts queues the next one
        # at any usage short of a whole prompt's worth.
        fits = self._waiting_fits(url, c, load)
        clear = (room and fits and load.kv_usage is not None
                 and load.kv_usage <= SLOT_EVIDENCE_KV and waiting > QUEUE_OK and running > 0)
        if not clear:
            if waiting > QUEUE_OK and c.slot_evidence and not (room and fits):
                self._log(f"{url}: {waiting} waiting with KV usage {load.kv_usage or 0:.0%}: "
                          "the cache binds, not a running limit")
            c.slot_evidence = 0
            return
        # A limit holds the count still; a first burst still being prefilled raises it.
        if running == c.slot_running and c.slot_evidence:
            c.slot_evidence += 1
        else:
            c.slot_evidence, c.slot_since = 1, load.at
        c.slot_running = running
        held = load.at - c.slot_since >= SLOT_EVIDENCE_S
        ceiling = running >= max(n for _, n in c.recent)
        if c.slot_evidence >= SLOT_READINGS and held and ceiling and running != c.max_running:
            c.max_running = running
            self._log(f"{url}: runs at most {running} requests at once ({waiting} waiting "
                      f"with KV usage {load.kv_usage:.0%}, {c.slot_evidence} readings in a "
                      f"row); sending at most {running + SLOT_QUEUE}")

    def _waiting_fits(self, url: str, c: _ServerControl, load: ServerLoad) -> bool:
        """Whether the cache's free part holds the largest prompt sent and not yet
        answered, a later turn's with the answers it carries (any of them may be the one
        the server queues); unknown: yes."""
        if c.capacity is None or load.kv_usage is None:
            return True
        largest = max((f.sample.prompt_tokens + f.earlier for f in self.books.flights.values()
                       if f.url == url and not f.written), default=0)
        return c.capacity * (1.0 - load.kv_usage) >= -(-largest // c.block) * c.block

    def _set(self, url: str, c: _ServerControl, factor: float, reason: str) -> None:
        factor = min(FACTOR_MAX, max(FACTOR_MIN, factor))
        if factor == c.factor:
            return
        before = c.target
        c.factor = factor
        c.preempted = c.finished = 0
        assert before is not None and c.target is not None
        self._log(f"{url}: target {before:,.0f} → {c.target:,.0f} KV tokens "
                  f"(×{factor:.2f} of capacity): {reason}")

    # --- admission ------------------------------------------------------------------

    def _unanswered(self, url: str) -> list[Flight]:
        """Requests on `url` in their first turn with no token yet, oldest first."""
        return [f for f in self.books.flights.values()
                if f.url == url and not f.written and not f.earlier]

    def _has_slot(self, server: ServerState) -> bool:
        limit = self.control(server.url).max_running
        if limit is not None and server.in_flight >= limit + SLOT_QUEUE:
            return False
        return len(self._unanswered(server.url)) < UNANSWERED

    def _free(self, server: ServerState) -> float:
        target = self.control(server.url).target
        if target is None:
            return float("inf")  # no capacity known: partition concurrency alone limits
        return target - max(self._projection(server.url))

    def pick(self, partitions: Sequence[PartitionView],
             servers: Sequence[ServerState]) -> tuple[str, ServerState] | None:
        ups = [s for s in servers if s.up and self._has_slot(s)]
        ready = [p for p in partitions if p.head is not None and p.in_flight < p.concurrency]
        if not ups or not ready:
            return None
        for p in ready:
            self._look_ahead(p.max_tokens)
        # Most free expected capacity; where it is unknown, fewest requests in flight.
        server = max(ups, key=lambda s: (self._free(s), -s.in_flight))
        part = max(ready, key=self._finish)
        head = part.head
        assert head is not None
        c = self.control(server.url)
        if c.target is None or not server.in_flight:
            return part.name, server
        curve = self._new_curve(head, server.url, c.block)
        peak = max(a + b for a, b in zip(self._projection(server.url), curve, strict=True))
        if peak <= c.target:
            self._candidate = (head.id, server.url, curve)
            return part.name, server
        return None

    def _finish(self, p: PartitionView) -> float:
        """Engine steps until the partition's queue drains at its present number in flight
        (each running request writes a token a step), plus its longest answers."""
        head = p.head
        assert head is not None
        lengths = self.books.lengths
        drain = p.queued * lengths.mean(head.category, head.max_tokens) / max(p.in_flight, 0.5)
        return drain + lengths.quantile(head.category, head.max_tokens, TAIL_QUANTILE)

    def recall(self, server: ServerState) -> list[str]:
        """Requests to call back from `server`: beyond its running limit + a short queue,
        the newest that have not begun to answer (first turn, no token yet)."""
        c = self.control(server.url)
        if c.max_running is None:
            return []
        # Never more than the server says wait: the rest may be in a long prefill.
        excess = min(server.in_flight - c.max_running, c.waiting or 0) - SLOT_QUEUE
        if excess <= 0:
            return []
        back = [f.sample.id for f in reversed(self._unanswered(server.url))][:excess]
        if back:
            self._log(f"{server.url}: calling back {len(back)} request(s) waiting "
                      f"beyond its limit of {c.max_running} running")
        return back

    def targets(self) -> Mapping[str, float]:
        return {url: c.target for url, c in self._control.items() if c.target is not None}

"""The run loop: plan → open the store → admit → stream → record.

One TaskGroup holds the dispatcher and the request tasks; the dispatcher creates a request
task only when the scheduler picks a partition's next sample and an up server for it, so a
run of 10^5 samples never holds more than the window of live requests. Outcomes go to the single
writer. A request cut off by a server outage or hang goes back to the front of its queue
without being charged a retry. A stop (signal, disk error, give-up) ends dispatch;
in-flight requests get a grace period, then are cancelled and stay pending.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen import __version__
from draftgen.client import ChatClient
from draftgen.clock import REAL_CLOCK, Clock
from draftgen.errors import JobError, RequestError, ServerDown
from draftgen.job import JobSpec, read_api_key
from draftgen.metrics import MetricsExporter
from draftgen.monitor import EventLog, RunMonitor
from draftgen.plan import Plan, build_plan
from draftgen.progress import ProgressView
from draftgen.replan import escalate, prefix_order, set_aside_too_long
from draftgen.retry import Backoff, with_retries
from draftgen.sample import (
    Failure,
    Record,
    Sample,
    Turn,
    base_body,
    request_body,
)
from draftgen.schedule.adaptive import AdaptiveScheduler
from draftgen.schedule.base import Flight, PartitionView, Scheduler
from draftgen.schedule.static import StaticScheduler
from draftgen.serverpool import ServerPool, ServerState
from draftgen.servers.attach import AttachedServers
from draftgen.servers.policy import QualityPolicyError
from draftgen.stats import RunStats, Snapshot
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter


@dataclass(frozen=True, slots=True)
class RunOptions:
    out_dir: Path
    servers: Sequence[str] = ()
    retry_failed: bool = False
    redo_changed: bool = False
    rerun_truncated: bool = False
    progress: bool | None = None  # None: live view only on a terminal
    grace_s: float = 30.0
    metrics_port: int | None = None  # serve Prometheus metrics here (0: a free port)


@dataclass(frozen=True, slots=True)
class RunSummary:
    out_dir: Path
    planned: int
    done: int
    failed: int
    truncated: int
    pending: int
    sent: int
    elapsed_s: float
    stopped: str | None = None
    snapshot: Snapshot | None = None
    # 0: finished or stopped on request; 3: gave up waiting for servers.
    exit_code: int = 0

    def line(self) -> str:
        head = f"{self.out_dir}: {self.done}/{self.planned} done, {self.failed} failed, "
        tail = f"{self.truncated} truncated, {self.pending} pending; sent {self.sent} this run"
        return head + tail + (f" (stopped: {self.stopped})" if self.stopped else "")


class _Bounce(Exception):
    """A request cut off by a server outage: re-queue it, charge nothing."""

    def __init__(self, err: ServerDown) -> None:
        super().__init__(str(err))
        self.err = err


@dataclass(slots=True)
class _Queue:
    samples: deque[Sample]
    in_flight: int = 0


@dataclass(slots=True)
class _RunState:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_reason: str | None = None
    exit_code: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    requeue: set[asyncio.Task[None]] = field(default_factory=set)
    by_sample: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # in flight
    outages: Counter[str] = field(default_factory=Counter)

    def forget(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self.by_sample.get(task.get_name()) is task:  # not yet sent again
            del self.by_sample[task.get_name()]

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.exit_code = exit_code
        self.stop.set()


class Runner:
    def __init__(self, job: JobSpec, opts: RunOptions, *, clock: Clock = REAL_CLOCK) -> None:
        self.job = job
        self.opts = opts
        self.clock = clock
        self.stats = RunStats(clock)
        self._base = base_body(job.model, job.sampling.model_dump())
        retry = job.client.retry
        self._backoff = Backoff(retry.backoff_base_s, retry.backoff_max_s, retry.max_attempts)
        self._rng = random.Random()
        self._state = _RunState()
        self._urls: list[str] = []
        self._queues: dict[str, _Queue] = {}
        self._wake = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self.pool: ServerPool | None = None
        self.metrics: MetricsExporter | None = None
        self.scheduler: Scheduler = (AdaptiveScheduler() if job.scheduler == "adaptive"
                                     else StaticScheduler())

    async def run(self) -> RunSummary:
        plan = build_plan(self.job)
        with RunStore.open(self.opts.out_dir) as store:
            plan, escalating = escalate(plan, self.job, store.entries,
                                        rerun=self.opts.rerun_truncated)
            todo = store.pending(plan.samples, retry_failed=self.opts.retry_failed,
                                 redo_changed=self.opts.redo_changed, redo=escalating)
            started = time.time()
            self._servers = AttachedServers(self.job, list(self.opts.servers),
                                            self.opts.out_dir / "servers")
            events = EventLog(self.opts.out_dir)
            self.scheduler._log = events.add
            try:
                async with AsyncExitStack() as stack:
                    if todo:
                        await stack.enter_async_context(self._servers)
                        self._urls = self._servers.urls
                        if not self._urls:
                            raise JobError("servers: no server to send to; list servers in "
                                           "the job or pass --server URL")
                        for url in self._urls:
                            await self._servers.verify(url)
                    client = await stack.enter_async_context(ChatClient(
                        api_key=read_api_key(self.job) if todo else None,
                        idle_timeout_s=self.job.client.idle_timeout_s,
                        connect_timeout_s=self.job.client.connect_timeout_s, clock=self.clock))
                    if todo:
                        context = await self._context_tokens(client)
                        if context is not None:
                            plan, todo = set_aside_too_long(plan, todo, context)
                    store.write_plan(plan.samples, plan.rejected)
                    self._count_plan(plan, store, {s.id for s in todo})
                    manifest = self._manifest_start(store, plan)
                    if todo:
                        await self._run(todo, client, events)
            finally:
                events.close()
            snap = self.stats.snapshot()
            summary = RunSummary(
                self.opts.out_dir, snap.total("planned"), snap.total("done"),
                snap.total("failed"), snap.total("truncated"), snap.total("pending"),
                snap.sent, snap.elapsed_s, self._state.stop_reason, snap,
                self._state.exit_code,
            )
            manifest["runs"][-1].update(
                ended_at=time.time(), duration_s=round(time.time() - started, 3),
                sent=summary.sent, done=summary.done, failed=summary.failed,
                truncated=summary.truncated, pending=summary.pending,
                stopped=summary.stopped, retries=snap.retries,
                scheduler=self.scheduler.name, events=events.messages[-200:],
                servers=self._servers.records,
            )
            store.write_manifest(manifest)
        return summary

    async def _context_tokens(self, client: ChatClient) -> int | None:
        """The smallest context length the servers report (None if none says)."""
        found = [await client.context_tokens(u) for u in self._urls]
        known = [n for n in found if n]
        return min(known) if known else None

    def _count_plan(self, plan: Plan, store: RunStore, todo: set[str]) -> None:
        done: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        trunc: Counter[str] = Counter()
        toks: Counter[str] = Counter()
        planned: Counter[str] = Counter()
        max_tokens: dict[str, int] = {}
        for s in plan.samples:
            planned[s.category] += 1
            max_tokens[s.category] = max(max_tokens.get(s.category, 0), s.max_tokens)
            e = store.entries.get(s.id)
            if e is None or s.id in todo:
                continue
            if e.status == "done":
                done[s.category] += 1
                trunc[s.category] += e.trunc
                toks[s.category] += e.otok
            else:
                failed[s.category] += 1
        for cat, n in planned.items():
            self.stats.plan(cat, planned=n, max_tokens=max_tokens[cat])
            self.stats.already(cat, done=done[cat], failed=failed[cat], truncated=trunc[cat],
                               output_tokens=toks[cat])
            self.scheduler.learn_prior(cat, done[cat], toks[cat])

    def _manifest_start(self, store: RunStore, plan: Plan) -> dict[str, Any]:
        manifest = store.read_manifest() or {"created_at": time.time(), "runs": []}
        manifest["draftgen_version"] = __version__
        manifest["job_file"] = str(self.job.source_file) if self.job.source_file else None
        manifest["job"] = self.job.model_dump(mode="json")
        manifest["plan"] = {
            "samples": len(plan.samples),
            "rejected": len(plan.rejected),
            "token_count": plan.token_count_label,
        }
        manifest["runs"].append({
            "started_at": time.time(),
            "servers": self._servers.records,
            "repair": {k: getattr(store.repair, k) for k in store.repair.__slots__},
        })
        store.write_manifest(manifest)
        return manifest

    async def _run(self, todo: list[Sample], client: ChatClient, events: EventLog) -> None:
        for s in (prefix_order(todo) if self.job.order == "prefix" else todo):
            self._queues.setdefault(s.partition, _Queue(deque())).samples.append(s)
        pool = self.pool = ServerPool(
            self._urls, clock=self.clock, probe=lambda url: self._probe(client, url),
            hang_timeout_s=self.job.client.hang_timeout_s,
            probe_timeout_s=self.job.client.probe_timeout_s, on_hang=self._cancel_for_requeue,
            on_up=lambda s: self._on_server_up(s, events), log=events.add,
        )
        monitor = RunMonitor(
            self.opts.out_dir, pool=pool, scheduler=self.scheduler, stats=self.stats,
            clock=self.clock, interval_s=self.job.poll_interval_s,
            give_up_s=self.job.client.server_down_give_up_s,
            waiting=lambda: sum(len(q.samples) + q.in_flight for q in self._queues.values()),
            wake=self._wake.set, give_up=self._give_up, log=events.add,
            metrics=self._start_metrics(events), recall=self._recall,
        )
        loop = asyncio.get_running_loop()
        signals = _install_signals(loop, self._on_signal)
        view = ProgressView(self.stats.snapshot, live=self.opts.progress,
                            interval_s=self.job.progress_interval_s)
        helpers: list[asyncio.Task[None]] = []
        try:
            async with monitor, OutcomeWriter(self.opts.out_dir) as writer:
                # Capacity must be known before the first admission, or a burst goes out blind.
                await monitor.poll()
                helpers = [asyncio.create_task(c) for c in (
                    view.run(), self._watch_writer(writer), pool.watch(self._state.stop),
                    monitor.run(self._state.stop))]
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._dispatch(client, writer, tg), name="dispatch")
                for t in helpers:
                    t.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
                monitor.record()
        finally:
            for t in helpers:
                t.cancel()
            await pool.close()
            _restore_signals(loop, signals)
            if self.metrics is not None:
                self.metrics.stop()

    def _start_metrics(self, events: EventLog) -> MetricsExporter | None:
        if self.opts.metrics_port is None:
            return None
        self.metrics = MetricsExporter()
        port = self.metrics.start(self.opts.metrics_port)
        events.add(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
        print(f"metrics: http://127.0.0.1:{port}/metrics", file=sys.stderr, flush=True)
        return self.metrics

    def _on_server_up(self, server: ServerState, events: EventLog) -> None:
        self._wake.set()
        task = asyncio.create_task(self._reverify(server.url, events))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reverify(self, url: str, events: EventLog) -> None:
        """A server back from an outage may have been restarted with other settings."""
        try:
            record = await self._servers.verify(url)
        except QualityPolicyError as e:
            events.add(f"{url} refused after its restart: {e}")
            self._stop(f"quality policy: {url} came back with a lossy KV cache", exit_code=2)
            self._cancel_in_flight()
            return
        if record is not None and record.get("changed_mid_run"):
            events.add(f"{url} came back with other settings: KV dtype "
                       f"{record.get('kv_dtype')}, {record.get('kv_tokens')} KV tokens")

    async def _probe(self, client: ChatClient, url: str) -> None:
        body = {"model": self.job.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "ping"}]}
        await client.chat(url, body)

    async def _watch_writer(self, writer: OutcomeWriter) -> None:
        await writer.failed.wait()
        self._stop("disk error", exit_code=1)
        self._cancel_in_flight()

    def _give_up(self, reason: str) -> None:
        self._stop(reason, exit_code=3)
        self._cancel_in_flight()

    def _stop(self, reason: str, exit_code: int = 0) -> None:
        self._state.request_stop(reason, exit_code)
        self._wake.set()

    def _on_signal(self, sig: int) -> None:
        if self._state.stop.is_set():
            self._state.stop_reason = "aborted by a second signal"
            self._cancel_in_flight()
            return
        self._stop(signal.Signals(sig).name)
        self.stats.note = (f"stopping: no new requests; waiting up to {self.opts.grace_s:.0f}s "
                           "for those in flight (signal again to abort)")
        asyncio.get_running_loop().call_later(self.opts.grace_s, self._cancel_in_flight)

    def _cancel_in_flight(self) -> None:
        for t in list(self._state.tasks):
            t.cancel()

    def _cancel_for_requeue(self, server: ServerState) -> None:
        self._requeue(list(server.tasks))

    def _recall(self, sample_ids: list[str]) -> None:
        """Call requests back from a server; they go to the front of their queue."""
        self._requeue([t for sid in sample_ids
                       if (t := self._state.by_sample.get(sid)) is not None and not t.done()])

    def _requeue(self, tasks: list[asyncio.Task[None]]) -> None:
        for t in tasks:
            self._state.requeue.add(t)
            t.cancel()

    def _views(self) -> list[PartitionView]:
        return [
            PartitionView(name, self.job.partitions[name].concurrency,
                          self.job.partitions[name].max_tokens, len(q.samples),
                          q.samples[0] if q.samples else None, q.in_flight)
            for name, q in self._queues.items()
        ]

    async def _dispatch(self, client: ChatClient, writer: OutcomeWriter,
                        tg: asyncio.TaskGroup) -> None:
        """Ask the scheduler what to send each time something changes; never busy-waits."""
        assert self.pool is not None
        while not self._state.stop.is_set():
            if not any(q.samples or q.in_flight for q in self._queues.values()):
                return
            self._wake.clear()
            picked = self.scheduler.pick(self._views(), self.pool.servers)
            if picked is None:
                # A request ends or comes back, a load reading, a server up, or a stop.
                await self._wake.wait()
                continue
            name, server = picked
            queue = self._queues[name]
            sample = queue.samples.popleft()
            queue.in_flight += 1
            self.pool.assign(server)
            flight = self.scheduler.started(sample, server)
            self.stats.started(sample.category)
            task = tg.create_task(self._request(flight, server, queue, client, writer),
                                  name=sample.id)
            self._state.tasks.add(task)
            self._state.by_sample[sample.id] = task
            server.tasks.add(task)
            task.add_done_callback(server.tasks.discard)
            task.add_done_callback(self._state.forget)

    async def _request(self, flight: Flight, server: ServerState, queue: _Queue,
                       client: ChatClient, writer: OutcomeWriter) -> None:
        assert self.pool is not None
        sample = flight.sample
        outcome: Record | Failure | None = None
        try:
            outcome = await self._generate(flight, server, client)
        except _Bounce as b:
            self.pool.mark_down(server, str(b.err))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task not in self._state.requeue:
                self.stats.cancelled(sample.category)
                raise
            self._state.requeue.discard(task)
            task.uncancel()
        finally:
            server.in_flight -= 1
            self.pool.progress(server)
            queue.in_flight -= 1
            self.scheduler.ended(sample, server, outcome.output_tokens
                                 if isinstance(outcome, Record) else None)
            self._wake.set()
        if outcome is None:
            # Cut off by an outage or a hang: back to the front, no retry charged.
            self.stats.cancelled(sample.category)
            queue.samples.appendleft(sample)
            return
        self.stats.finished(outcome)
        await writer.put(outcome)

    async def _generate(self, flight: Flight, server: ServerState,
                        client: ChatClient) -> Record | Failure:
        sample = flight.sample
        messages = list(sample.messages)
        turns: list[Turn] = []
        attempts = 0
        followups = list(sample.followups)
        pool = self.pool
        assert pool is not None

        def on_token(written: int) -> None:
            self.stats.token(written - flight.written)
            if not flight.written:
                self._wake.set()  # a first token may let the scheduler send more
            flight.written = written
            pool.progress(server)

        async def send(body: dict[str, Any]) -> Any:
            flight.written = 0  # a retry streams the answer again from its start
            try:
                return await client.chat(server.url, body, on_token=on_token)
            except ServerDown as e:
                self._state.outages[sample.id] += 1
                if self._state.outages[sample.id] <= self.job.client.max_outage_requeues:
                    raise _Bounce(e) from e
                raise

        while True:
            body = request_body(sample, self._base, messages)
            try:
                done, used = await with_retries(
                    lambda body=body: send(body),  # type: ignore[misc]
                    self._backoff, clock=self.clock, rng=self._rng,
                    on_retry=lambda *_: self.stats.retried(),
                )
            except RequestError as e:
                return Failure(sample.id, sample.fingerprint, sample.category, sample.partition,
                               e.reason, str(e), attempts + getattr(e, "attempts", 1),
                               server.url, self.clock.time())
            attempts += used
            if done.finish_reason == "content_filter":
                return Failure(sample.id, sample.fingerprint, sample.category, sample.partition,
                               "content_filter", "the server's content filter stopped the "
                               "answer", attempts, server.url, self.clock.time())
            turns.append(done)
            # A truncated reply ends the chain: the next user turn would answer a cut-off text.
            if not followups or done.finish_reason == "length":
                break
            flight.next_turn()
            messages.append({"role": "assistant", "content": done.content})
            messages.append({"role": "user", "content": followups.pop(0)})
        return Record(sample.id, sample.fingerprint, sample.category, sample.partition,
                      sample.messages, sample.followups, tuple(turns), server.url, attempts,
                      self.clock.time())


def _install_signals(loop: asyncio.AbstractEventLoop, handler: Any) -> list[tuple[int, Any]]:
    """Graceful-stop handlers for the dispatch phase; returns what to restore after it."""
    installed: list[tuple[int, Any]] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        try:
            loop.add_signal_handler(sig, handler, sig)
            installed.append((sig, previous))
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    return installed


def _restore_signals(loop: asyncio.AbstractEventLoop, installed: list[tuple[int, Any]]) -> None:
    for sig, previous in installed:
        loop.remove_signal_handler(sig)
        signal.signal(sig, previous)


async def run_job(job: JobSpec, opts: RunOptions, *, clock: Clock = REAL_CLOCK) -> RunSummary:
    return await Runner(job, opts, clock=clock).run()


__all__ = ["RunOptions", "RunSummary", "Runner", "run_job"]

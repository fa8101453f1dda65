"""The run loop: plan → open the store → admit → stream → record.

One TaskGroup holds a dispatcher per partition, the progress view and the request tasks;
a partition's dispatcher only creates a request task once its concurrency allows, so a run
of 10^5 samples never holds more than the window of live requests. Outcomes go to the single
writer. A stop (signal, disk error) ends dispatch; in-flight requests get a grace period,
then are cancelled and stay pending for the next run.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen import __version__
from draftgen.client import ChatClient
from draftgen.clock import REAL_CLOCK, Clock
from draftgen.errors import JobError, RequestError
from draftgen.job import JobSpec
from draftgen.plan import Plan, build_plan
from draftgen.progress import ProgressView
from draftgen.retry import Backoff, with_retries
from draftgen.sample import Failure, Record, Sample, Turn, base_body, request_body
from draftgen.stats import RunStats, Snapshot
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter


@dataclass(frozen=True, slots=True)
class RunOptions:
    out_dir: Path
    servers: Sequence[str] = ()
    retry_failed: bool = False
    redo_changed: bool = False
    progress: bool | None = None  # None: live view only on a terminal
    grace_s: float = 30.0


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

    def line(self) -> str:
        head = f"{self.out_dir}: {self.done}/{self.planned} done, {self.failed} failed, "
        tail = f"{self.truncated} truncated, {self.pending} pending; sent {self.sent} this run"
        return head + tail + (f" (stopped: {self.stopped})" if self.stopped else "")


@dataclass(slots=True)
class _Server:
    url: str
    in_flight: int = 0


@dataclass(slots=True)
class _RunState:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_reason: str | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stop.set()


def api_key(job: JobSpec) -> str | None:
    if job.api_key_env is None:
        return None
    key = os.environ.get(job.api_key_env)
    if not key:
        raise JobError(f"api_key_env: environment variable {job.api_key_env} is not set")
    return key


class Runner:
    def __init__(self, job: JobSpec, opts: RunOptions, *, clock: Clock = REAL_CLOCK) -> None:
        self.job = job
        self.opts = opts
        self.clock = clock
        self.stats = RunStats(clock)
        self._base = base_body(job.model, job.sampling.model_dump())
        self._backoff = Backoff(job.client.retry.backoff_base_s, job.client.retry.backoff_max_s,
                                job.client.retry.max_attempts)
        self._rng = random.Random()
        self._state = _RunState()
        urls = list(opts.servers) or [s.url for s in job.servers]
        self._servers = [_Server(u.rstrip("/")) for u in urls]

    async def run(self) -> RunSummary:
        plan = build_plan(self.job)
        with RunStore.open(self.opts.out_dir) as store:
            todo = store.pending(plan.samples, retry_failed=self.opts.retry_failed,
                                 redo_changed=self.opts.redo_changed)
            store.write_plan(plan.samples, plan.rejected)
            self._count_plan(plan, store, {s.id for s in todo})
            manifest = self._manifest_start(store, plan)
            started = time.time()
            if todo:
                if not self._servers:
                    raise JobError("servers: no server to send to; list servers in the job "
                                   "or pass --server URL")
                await self._run(todo)
            snap = self.stats.snapshot()
            summary = RunSummary(
                self.opts.out_dir, snap.total("planned"), snap.total("done"),
                snap.total("failed"), snap.total("truncated"), snap.total("pending"),
                snap.sent, snap.elapsed_s, self._state.stop_reason, snap,
            )
            manifest["runs"][-1].update(
                ended_at=time.time(), duration_s=round(time.time() - started, 3),
                sent=summary.sent, done=summary.done, failed=summary.failed,
                truncated=summary.truncated, pending=summary.pending,
                stopped=summary.stopped, retries=snap.retries,
            )
            store.write_manifest(manifest)
        return summary

    def _count_plan(self, plan: Plan, store: RunStore, todo: set[str]) -> None:
        planned: Counter[str] = Counter(s.category for s in plan.samples)
        for s in plan.samples:
            self.stats.plan(s.category, planned=0, max_tokens=s.max_tokens)
        for cat, n in planned.items():
            self.stats.plan(cat, planned=n, max_tokens=0)
        done: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        trunc: Counter[str] = Counter()
        toks: Counter[str] = Counter()
        for s in plan.samples:
            e = store.entries.get(s.id)
            if e is None or s.id in todo:
                continue
            if e.status == "done":
                done[s.category] += 1
                trunc[s.category] += e.trunc
                toks[s.category] += e.otok
            else:
                failed[s.category] += 1
        for cat in planned:
            self.stats.already(cat, done=done[cat], failed=failed[cat], truncated=trunc[cat],
                               output_tokens=toks[cat])

    def _manifest_start(self, store: RunStore, plan: Plan) -> dict[str, Any]:
        manifest = store.read_manifest() or {
            "draftgen_version": __version__,
            "created_at": time.time(),
            "runs": [],
        }
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
            "servers": [s.url for s in self._servers],
            "repair": {k: getattr(store.repair, k) for k in store.repair.__slots__},
        })
        store.write_manifest(manifest)
        return manifest

    async def _run(self, todo: list[Sample]) -> None:
        by_partition: dict[str, list[Sample]] = {}
        for s in todo:
            by_partition.setdefault(s.partition, []).append(s)
        loop = asyncio.get_running_loop()
        signals = _install_signals(loop, self._on_signal)
        view = ProgressView(self.stats.snapshot, live=self.opts.progress,
                            interval_s=self.job.progress_interval_s)
        try:
            async with (
                ChatClient(api_key=api_key(self.job), idle_timeout_s=self.job.client.idle_timeout_s,
                           connect_timeout_s=self.job.client.connect_timeout_s,
                           clock=self.clock) as client,
                OutcomeWriter(self.opts.out_dir) as writer,
            ):
                progress = asyncio.create_task(view.run(), name="progress")
                watch = asyncio.create_task(self._watch_writer(writer))
                try:
                    async with asyncio.TaskGroup() as tg:
                        for name, samples in by_partition.items():
                            tg.create_task(self._dispatch(name, samples, client, writer, tg))
                finally:
                    progress.cancel()
                    watch.cancel()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        if writer.error is not None:
            raise writer.error

    async def _watch_writer(self, writer: OutcomeWriter) -> None:
        await writer.failed.wait()
        self._state.request_stop("disk error")
        self._cancel_in_flight()

    def _on_signal(self, sig: int) -> None:
        if self._state.stop.is_set():
            self._state.stop_reason = "aborted by a second signal"
            self._cancel_in_flight()
            return
        self._state.request_stop(f"{signal.Signals(sig).name}")
        self.stats.note = (f"stopping: no new requests; waiting up to {self.opts.grace_s:.0f}s "
                           "for those in flight (signal again to abort)")
        asyncio.get_running_loop().call_later(self.opts.grace_s, self._cancel_in_flight)

    def _cancel_in_flight(self) -> None:
        for t in list(self._state.tasks):
            t.cancel()

    async def _dispatch(self, partition: str, samples: list[Sample], client: ChatClient,
                        writer: OutcomeWriter, tg: asyncio.TaskGroup) -> None:
        slots = asyncio.Semaphore(self.job.partitions[partition].concurrency)
        stop = self._state.stop
        for sample in samples:
            await slots.acquire()
            if stop.is_set():
                slots.release()
                return
            server = min(self._servers, key=lambda s: s.in_flight)
            server.in_flight += 1
            self.stats.started(sample.category)
            task = tg.create_task(self._request(sample, server, client, writer, slots))
            self._state.tasks.add(task)
            task.add_done_callback(self._state.tasks.discard)

    async def _request(self, sample: Sample, server: _Server, client: ChatClient,
                       writer: OutcomeWriter, slots: asyncio.Semaphore) -> None:
        try:
            outcome = await self._generate(sample, server.url, client)
        except asyncio.CancelledError:
            self.stats.cancelled(sample.category)
            raise
        finally:
            server.in_flight -= 1
            slots.release()
        self.stats.finished(outcome)
        await writer.put(outcome)

    async def _generate(self, sample: Sample, url: str, client: ChatClient) -> Record | Failure:
        messages = list(sample.messages)
        turns: list[Turn] = []
        attempts = 0
        followups = list(sample.followups)
        while True:
            body = request_body(sample, self._base, messages)
            try:
                done, used = await with_retries(
                    lambda body=body: client.chat(url, body, on_token=self.stats.token),  # type: ignore[misc]
                    self._backoff, clock=self.clock, rng=self._rng,
                    on_retry=lambda *_: self.stats.retried(),
                )
            except RequestError as e:
                return Failure(sample.id, sample.fingerprint, sample.category, sample.partition,
                               e.reason, str(e), attempts + getattr(e, "attempts", 1), url,
                               self.clock.time())
            attempts += used
            turns.append(Turn(done.content, done.reasoning, done.finish_reason,
                              done.prompt_tokens, done.completion_tokens, done.ttft_s,
                              done.duration_s))
            # A truncated reply ends the chain: the next user turn would answer a cut-off text.
            if not followups or done.finish_reason == "length":
                break
            messages.append({"role": "assistant", "content": done.content})
            messages.append({"role": "user", "content": followups.pop(0)})
        return Record(sample.id, sample.fingerprint, sample.category, sample.partition,
                      sample.messages, sample.followups, tuple(turns), url, attempts,
                      self.clock.time())


def _install_signals(loop: asyncio.AbstractEventLoop, handler: Any) -> list[int]:
    installed: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handler, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    return installed


async def run_job(job: JobSpec, opts: RunOptions, *, clock: Clock = REAL_CLOCK) -> RunSummary:
    return await Runner(job, opts, clock=clock).run()


__all__ = ["RunOptions", "RunSummary", "Runner", "run_job"]

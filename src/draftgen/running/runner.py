"""A run from start to end: plan → open the store → attach servers → send → record.

The runner sets up what a run needs (the plan against the store, the servers, the client,
the manifest), then holds one TaskGroup with the dispatcher (`dispatch.py`: what to send
where) and the request tasks (`request.py`: one request's life); outcomes go to the single
writer. A stop ends dispatch: after a signal, in-flight requests get a grace period; after
a disk error, a give-up, a run-level error or a refused server they are cancelled at once.
Either way they stay pending.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen import __version__
from draftgen.client import ChatClient
from draftgen.client.http import open_session
from draftgen.clock import REAL_CLOCK, Clock
from draftgen.errors import JobError
from draftgen.job import JobSpec, read_api_key
from draftgen.planning.plan import Plan, build_plan
from draftgen.planning.replan import escalate, prefix_order
from draftgen.running.attach import AttachedServers
from draftgen.running.dispatch import Dispatcher
from draftgen.running.gateways import GatewayWorkers
from draftgen.running.metrics import MetricsExporter
from draftgen.running.monitor import EventLog, RunMonitor
from draftgen.running.progress import ProgressView
from draftgen.running.request import Requester
from draftgen.running.signals import install_signals, restore_signals
from draftgen.running.startup import StartUp
from draftgen.running.state import RunState
from draftgen.running.stats import RunStats, Snapshot
from draftgen.sample import Sample
from draftgen.schedule.adaptive import AdaptiveScheduler
from draftgen.schedule.base import Scheduler
from draftgen.schedule.pool import Route, ServerPool, ServerState
from draftgen.schedule.static import StaticScheduler
from draftgen.servers.policy import QualityPolicyError
from draftgen.store import RunStore
from draftgen.store.reading import UNVERIFIED
from draftgen.store.tally import CategoryTally, tally
from draftgen.store.writer import OutcomeWriter


@dataclass(frozen=True, slots=True)
class RunOptions:
    out_dir: Path
    servers: Sequence[str] = ()
    gateways: Sequence[str] = ()  # `run --gateway URL`: in place of the job's servers
    retry_failed: bool = False
    redo_changed: bool = False
    rerun_truncated: bool = False
    # Regenerate every sample a server wrote under these configurations (ids in the
    # manifest's `configurations`, as `status` lists them).
    redo_configs: tuple[str, ...] = ()
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


class Runner:
    def __init__(self, job: JobSpec, opts: RunOptions, *, clock: Clock = REAL_CLOCK) -> None:
        self.job = job
        self.opts = opts
        self.clock = clock
        self.stats = RunStats(clock)
        self._state = RunState()
        self._urls: list[str] = []
        self._gateways: GatewayWorkers | None = None
        self._routes: dict[str, Route] = {}  # gateway workers: how each is addressed
        self._store: RunStore | None = None
        self._manifest: dict[str, Any] = {}
        self._say_event: Callable[[str], None] = lambda _msg: None
        self._rejected: set[str] = set()  # --redo-config
        self._context: dict[str, Any] = {}  # the context the plan was fitted to
        self.pool: ServerPool | None = None
        self.metrics: MetricsExporter | None = None
        self.scheduler: Scheduler = (AdaptiveScheduler() if job.scheduler == "adaptive"
                                     else StaticScheduler())

    async def run(self) -> RunSummary:
        plan = build_plan(self.job)
        with RunStore.open(self.opts.out_dir) as store:
            plan, escalating = escalate(plan, self.job, store.entries,
                                        rerun=self.opts.rerun_truncated)
            rejected = set(self.opts.redo_configs)
            previous = store.read_manifest() or {}  # what earlier runs recorded
            known = set(previous.get("configurations") or {})
            if unknown := sorted(rejected - known - {UNVERIFIED}):
                raise JobError(f"--redo-config: no configuration {', '.join(unknown)} in "
                               f"{self.opts.out_dir} (`draftgen status` lists them)")
            regenerate = {e.id for e in store.entries.values()
                          if (e.configuration or UNVERIFIED) in rejected}
            self._rejected = rejected
            todo = store.pending(plan.samples, retry_failed=self.opts.retry_failed,
                                 redo_changed=self.opts.redo_changed, redo=escalating,
                                 regenerate=regenerate)
            started = time.time()
            api_key = read_api_key(self.job) if todo else None
            self._servers = AttachedServers(self.job, list(self.opts.servers),
                                            self.opts.out_dir / "servers", api_key=api_key,
                                            override_gateways=list(self.opts.gateways))
            events = EventLog(self.opts.out_dir)
            self.scheduler.set_log(events.add)
            try:
                async with AsyncExitStack() as stack:
                    client = await stack.enter_async_context(ChatClient(
                        api_key=api_key,
                        idle_timeout_s=self.job.client.idle_timeout_s,
                        connect_timeout_s=self.job.client.connect_timeout_s, clock=self.clock))
                    start = StartUp(self.job, client, self.clock, say=self._say(events))
                    self._say_event = start.say
                    for warning in plan.warnings:
                        start.say(f"warning: {warning}")
                    saved = previous.get("context") or {}
                    done = {i for i, e in store.entries.items() if e.status == "done"}
                    # As an earlier run decided: what it set aside is not work to wait for.
                    fitted = await start.fit(plan, todo, saved=saved, done=done, quiet=True)
                    if fitted.todo:
                        await stack.enter_async_context(self._servers)
                        self._urls = list(self._servers.urls)
                        if self._servers.gateways:
                            session = await stack.enter_async_context(
                                open_session(api_key, timeout_s=self.job.client.probe_timeout_s))
                            self._gateways = GatewayWorkers(
                                list(self._servers.gateways), client=client, session=session,
                                model=self.job.model, verify=self._verify_worker,
                                clock=self.clock, log=start.say)
                            self._routes = await self._gateways.discover()
                            self._urls += list(self._routes)
                        if not self._urls:
                            raise JobError("servers: no server to send to; list servers in "
                                           "the job or pass --server URL")
                        ask = self._gateways.reachable(self._urls) if self._gateways else self._urls
                        if gave_up := await start.await_servers(
                                ask, self._servers.relayed_contexts()):
                            self._stop(gave_up, exit_code=3)
                        for url in self._urls:
                            if url in self._routes:
                                continue  # verified when found
                            await self._servers.verify(url)
                            if self._servers.configuration_of(url) in rejected:
                                raise JobError(
                                    f"--redo-config: {url} still runs configuration "
                                    f"{self._servers.configuration_of(url)}; restart it with "
                                    "the settings you want first")
                        fitted = await start.fit(plan, todo, saved=saved, done=done)
                    plan, todo, self._context = fitted
                    store.write_plan(plan.samples, plan.rejected)
                    self._count_plan(plan, store, {s.id for s in todo})
                    manifest = self._manifest = self._manifest_start(store, plan)
                    self._store = store
                    if todo and not self._state.stop.is_set():
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
            manifest.setdefault("configurations", {}).update(self._servers.configurations)
            manifest["runs"][-1].update(
                ended_at=time.time(), duration_s=round(time.time() - started, 3),
                sent=summary.sent, done=summary.done, failed=summary.failed,
                truncated=summary.truncated, pending=summary.pending,
                stopped=summary.stopped, retries=snap.retries,
                scheduler=self.scheduler.name, scheduler_state=self.scheduler.state(),
                events=events.messages[-200:],
                servers=self._servers.records,
            )
            store.write_manifest(manifest)
        return summary

    def _count_plan(self, plan: Plan, store: RunStore, todo: set[str]) -> None:
        # What earlier runs did: the entries of the samples this run will not send again.
        counted = tally(((s.category, None if s.id in todo else store.entries.get(s.id))
                         for s in plan.samples), CategoryTally)
        for cat, c in counted.categories.items():
            self.stats.plan(cat, planned=c.total)
            self.stats.already(cat, done=c.done, failed=c.failed, truncated=c.truncated,
                               output_tokens=c.output_tokens)
            self.scheduler.learn_prior(cat, c.done, c.output_tokens)

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
        manifest.setdefault("configurations", {}).update(self._servers.configurations)
        if manifest["runs"] and manifest["runs"][-1].get("scheduler") == self.scheduler.name:
            self.scheduler.restore(manifest["runs"][-1].get("scheduler_state") or {})
        if self._context:
            manifest["context"] = self._context
        manifest["runs"].append({
            "started_at": time.time(),
            "servers": self._servers.records,
            "repair": {k: getattr(store.repair, k) for k in store.repair.__slots__},
        })
        store.write_manifest(manifest)
        return manifest

    async def _run(self, todo: list[Sample], client: ChatClient, events: EventLog) -> None:
        state = self._state
        gateways = self._gateways
        for url, limit in self._servers.launched_limits.items():
            self.scheduler.limit_known(url, limit, "the profile draftgen launched it with")
        pool = self.pool = ServerPool(
            self._urls, clock=self.clock, routes=self._routes,
            probe=lambda server: self._probe(client, server, events),
            hang_timeout_s=self.job.client.hang_timeout_s,
            probe_timeout_s=self.job.client.probe_timeout_s,
            on_hang=lambda server: state.requeue_tasks(list(server.tasks)),
            on_up=lambda _server: state.wake.set(), log=events.add,
        )
        dispatcher = Dispatcher(prefix_order(todo) if self.job.order == "prefix" else todo,
                                self.job.partitions, scheduler=self.scheduler, pool=pool,
                                stats=self.stats, state=state)
        monitor = RunMonitor(
            self.opts.out_dir, pool=pool, scheduler=self.scheduler, stats=self.stats,
            clock=self.clock, interval_s=self.job.poll_interval_s,
            give_up_s=self.job.client.server_down_give_up_s, waiting=dispatcher.waiting,
            wake=state.wake.set, give_up=self._give_up, log=events.add,
            metrics=self._start_metrics(events), recall=state.recall,
            api_key=self._servers.api_key,
        )
        loop = asyncio.get_running_loop()
        signals = install_signals(loop, self._on_signal)
        view = ProgressView(self.stats.snapshot, live=self.opts.progress,
                            interval_s=self.job.progress_interval_s)
        helpers: list[asyncio.Task[None]] = []
        try:
            async with monitor, OutcomeWriter(self.opts.out_dir) as writer:
                # Capacity must be known before the first admission, or a burst goes out blind.
                await monitor.poll()
                helpers = [asyncio.create_task(c) for c in (
                    view.run(), self._watch_writer(writer), pool.watch(state.stop),
                    monitor.run(state.stop))]
                if gateways is not None:
                    helpers.append(asyncio.create_task(gateways.watch(pool, state.stop)))
                requester = Requester(self.job, client=client, writer=writer, pool=pool,
                                      scheduler=self.scheduler, stats=self.stats, state=state,
                                      clock=self.clock,
                                      server_fields=self._servers.request_fields,
                                      server_config=self._servers.configuration_of,
                                      served=gateways.served if gateways else lambda _s, _w: True,
                                      context=self._context.get("tokens"))
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(dispatcher.run(requester, tg), name="dispatch")
                for t in helpers:
                    t.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
                monitor.record()
        finally:
            for t in helpers:
                t.cancel()
            await pool.close()
            restore_signals(loop, signals)
            if self.metrics is not None:
                self.metrics.stop()

    @staticmethod
    def _say(events: EventLog) -> Callable[[str], None]:
        """Start-up news: for the person watching and for the event log."""
        def say(message: str) -> None:
            events.add(message)
            print(message, file=sys.stderr, flush=True)
        return say

    def _start_metrics(self, events: EventLog) -> MetricsExporter | None:
        if self.opts.metrics_port is None:
            return None
        self.metrics = MetricsExporter()
        port = self.metrics.start(self.opts.metrics_port)
        events.add(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
        print(f"metrics: http://127.0.0.1:{port}/metrics", file=sys.stderr, flush=True)
        return self.metrics

    async def _verify_worker(self, gateway: str, url: str, relayed: bool) -> bool:
        """A gateway's worker, verified like a server: False when the policy refuses it."""
        self._servers.worker_of(gateway, url, relayed=relayed)
        try:
            record = await self._servers.verify(url)
        except QualityPolicyError as e:
            self._say_event(f"{url}: {e}")
            return False
        if self._servers.configuration_of(url) in self._rejected:
            self._say_event(f"{url} runs configuration {self._servers.configuration_of(url)}, "
                            "which this run regenerates (--redo-config)")
            return False
        if record is not None:
            self._save_configurations()
        return True

    def _save_configurations(self) -> None:
        if self._store is not None:
            self._manifest.setdefault("configurations", {}).update(
                self._servers.configurations)
            self._store.write_manifest(self._manifest)

    async def _probe(self, client: ChatClient, server: ServerState, events: EventLog) -> None:
        """A down server is up again once it generates and has been verified again: it may
        have been restarted with other settings, and it takes no request before that. A
        gateway's worker is up once a routing key lands on it again (a restarted gateway
        has forgotten every pin)."""
        url = server.url
        if server.route is not None and self._gateways is not None:
            await self._gateways.reach(server)
        else:
            body = {"model": self.job.model, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "ping"}]}
            await client.chat(url, body)
        try:
            record = await self._servers.verify(url)
        except QualityPolicyError as e:
            events.add(f"{url} refused after its restart: {e}")
            self._stop(f"quality policy: {url} came back with a lossy KV cache", exit_code=2)
            self._state.cancel_in_flight()
            raise
        if (config := self._servers.configuration_of(url)) in self._rejected:
            # Its samples would be regenerated again: it stays down until restarted.
            events.add(f"{url} came back with configuration {config}, which this run "
                       "regenerates (--redo-config); not sending to it")
            raise JobError(f"{url} runs a rejected configuration ({config})")
        if record is not None:
            settings = (f"KV dtype {record.get('kv_dtype')}, {record.get('kv_tokens')} KV "
                        "tokens")
            events.add(f"{url} came back with other settings: {settings}"
                       if record.get("changed_mid_run") else f"{url} answers: {settings}")
            # Records name the new configuration from now on: a crash must not lose it.
            self._save_configurations()

    async def _watch_writer(self, writer: OutcomeWriter) -> None:
        await writer.failed.wait()
        self._stop("disk error", exit_code=1)
        self._state.cancel_in_flight()

    def _give_up(self, reason: str) -> None:
        self._stop(reason, exit_code=3)
        self._state.cancel_in_flight()

    def _stop(self, reason: str, exit_code: int = 0) -> None:
        self._state.request_stop(reason, exit_code)

    def _on_signal(self, sig: int) -> None:
        if self._state.stop.is_set():
            self._state.stop_reason = "aborted by a second signal"
            self._state.cancel_in_flight()
            return
        self._stop(signal.Signals(sig).name)
        self.stats.note = (f"stopping: no new requests; waiting up to {self.opts.grace_s:.0f}s "
                           "for those in flight (signal again to abort)")
        asyncio.get_running_loop().call_later(self.opts.grace_s, self._state.cancel_in_flight)


async def run_job(job: JobSpec, opts: RunOptions, *, clock: Clock = REAL_CLOCK) -> RunSummary:
    return await Runner(job, opts, clock=clock).run()


__all__ = ["RunOptions", "RunSummary", "Runner", "run_job"]

"""One request's life: send it, stream it, retry what is transient, go back to the queue
when its server is cut off, and hand the outcome to the writer.

A request cut off by a server outage goes back to the front of its partition's queue
without being charged a retry, up to `client.max_outage_requeues` outages per sample; after
that an outage counts like any transient error. One called back (a hang, or sent beyond a
server's running limit) goes back uncharged and uncounted. A run-level error (`RunError`)
stops the run and charges nothing. Multi-turn samples send each
follow-up turn after the previous answer; a truncated answer ends the chain.

The context, turn by turn (`context.py`): a later turn carries the answers so far, which no
plan-time count includes, so before it is sent its prompt is reckoned from what the server
counted of the last turn (its prompt and answer) plus the new user turn; where it and
`max_tokens` would pass the context, `over_context: shorten` sends it with the room left,
and `set_aside` (or no room at all) ends the chain there, the turns that fit recorded. A
server's own "context length exceeded" is the same decision: shortened and sent again where
its message says how long the prompt was and a shorter answer fits, else the chain ends (a
first turn that cannot fit fails, as it would have at plan time).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from typing import Any

from draftgen.client import ChatClient
from draftgen.clock import Clock
from draftgen.errors import ContextTooLong, RequestError, RunError, ServerDown
from draftgen.job import JobSpec
from draftgen.running.context import MIN_ANSWER_TOKENS, later_turn_room, room_after_refusal
from draftgen.running.retry import Backoff, with_retries
from draftgen.running.state import PartitionQueue, RunState
from draftgen.running.stats import RunStats
from draftgen.sample import Failure, Record, Sample, Turn, base_body, request_body
from draftgen.schedule.base import Flight, Scheduler
from draftgen.schedule.pool import ServerPool, ServerState
from draftgen.store.writer import OutcomeWriter


class _Bounce(Exception):
    """A request cut off by a server outage, or answered by a gateway's worker the run has
    not accepted: re-queue it, charge nothing."""

    def __init__(self, err: RequestError) -> None:
        super().__init__(str(err))
        self.err = err


class Requester:
    """Runs request tasks for one run; `send` is the body of each."""

    def __init__(self, job: JobSpec, *, client: ChatClient, writer: OutcomeWriter,
                 pool: ServerPool, scheduler: Scheduler, stats: RunStats, state: RunState,
                 clock: Clock,
                 server_fields: Callable[[str], Mapping[str, Any]] = lambda _url: {},
                 server_config: Callable[[str], str | None] = lambda _url: None,
                 served: Callable[[ServerState, str | None], bool] = lambda _s, _w: True,
                 context: int | None = None) -> None:
        self._client = client
        self._served = served
        self._context = context
        self._shorten = job.over_context == "shorten"
        self._server_config = server_config
        self._server_fields = server_fields
        self._writer = writer
        self._pool = pool
        self._scheduler = scheduler
        self._stats = stats
        self._state = state
        self._clock = clock
        self._base = base_body(job.model, job.sampling.model_dump())
        retry = job.client.retry
        self._backoff = Backoff(retry.backoff_base_s, retry.backoff_max_s, retry.max_attempts)
        self._max_outage_requeues = job.client.max_outage_requeues
        self._rng = random.Random()
        self._begun: set[asyncio.Task[None]] = set()  # tasks whose `send` has started

    def settle(self, task: asyncio.Task[None], flight: Flight, server: ServerState,
               queue: PartitionQueue) -> None:
        """Done callback of every request task. One cancelled before its first step (called
        back, or cut off by a hang or a stop, the moment it was created) never ran `send`,
        nor its `finally`: release what was taken for it here, and put a called-back sample
        back at the front of its queue (at a stop it stays pending in the plan)."""
        if task in self._begun:
            self._begun.discard(task)
            return
        self._release(flight.sample, server, queue, None)
        self._stats.cancelled(flight.sample.category)
        if task in self._state.requeue:
            self._state.requeue.discard(task)
            queue.samples.appendleft(flight.sample)

    def _release(self, sample: Sample, server: ServerState, queue: PartitionQueue,
                 outcome: Record | Failure | None) -> None:
        server.in_flight -= 1
        self._pool.progress(server)
        queue.in_flight -= 1
        self._scheduler.ended(sample, server, outcome.output_tokens
                              if isinstance(outcome, Record) else None)
        self._state.wake.set()

    async def send(self, flight: Flight, server: ServerState, queue: PartitionQueue) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._begun.add(task)  # from here on, `finally` below releases it
        sample = flight.sample
        outcome: Record | Failure | None = None
        try:
            outcome = await self._generate(flight, server)
        except _Bounce as b:
            self._pool.mark_down(server, str(b.err))
        except RunError as e:
            # Every sample would fail the same way: stop the run, charge none.
            self._state.request_stop(f"{server.url}: {e}", exit_code=1)
            self._state.cancel_in_flight(but=asyncio.current_task())
        except asyncio.CancelledError:
            if task is None or task not in self._state.requeue:
                self._stats.cancelled(sample.category)
                raise
            self._state.requeue.discard(task)
            task.uncancel()
        finally:
            self._release(sample, server, queue, outcome)
        if outcome is None:
            # Cut off by an outage or a hang: back to the front, no retry charged.
            self._stats.cancelled(sample.category)
            queue.samples.appendleft(sample)
            return
        self._stats.finished(outcome)
        await self._writer.put(outcome)

    async def _generate(self, flight: Flight, server: ServerState) -> Record | Failure:
        sample = flight.sample
        messages = list(sample.messages)
        turns: list[Turn] = []
        attempts = 0
        followups = list(sample.followups)

        def on_token(written: int) -> None:
            self._stats.token(written - flight.written)
            if not flight.written:
                self._state.wake.set()  # a first token may let the scheduler send more
            flight.written = written
            self._pool.progress(server)

        async def send(body: dict[str, Any]) -> Any:
            flight.written = 0  # a retry streams the answer again from its start
            try:
                done = await self._client.chat(server.send_url, body, on_token=on_token,
                                               headers=server.headers)
            except ServerDown as e:
                self._state.outages[sample.id] += 1
                if self._state.outages[sample.id] <= self._max_outage_requeues:
                    raise _Bounce(e) from e
                raise
            if not self._served(server, done.served_by):
                raise _Bounce(ServerDown(f"answered by {done.served_by}, not an accepted "
                                         "worker"))
            return done

        extra = self._server_fields(server.url)
        max_tokens: int | None = None  # a later turn's own, where the context shortens it
        while True:
            body = request_body(sample, self._base, messages)
            body.update(extra)
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            try:
                done, used = await with_retries(
                    lambda body=body: send(body),  # type: ignore[misc]
                    self._backoff, clock=self._clock, rng=self._rng,
                    on_retry=lambda *_: self._stats.retried(),
                )
            except RunError:
                raise
            except ContextTooLong as e:
                attempts += getattr(e, "attempts", 1)
                room = room_after_refusal(str(e), self._context)
                if self._shorten and room is not None and room < body["max_tokens"]:
                    max_tokens = room  # the same turn again, with the answer that fits
                    continue
                if turns:
                    break  # a later turn that cannot fit: the chain ends with what fit
                return Failure(sample.id, sample.fingerprint, sample.category, sample.partition,
                               e.reason, str(e), attempts, server.url, self._clock.time())
            except RequestError as e:
                return Failure(sample.id, sample.fingerprint, sample.category, sample.partition,
                               e.reason, str(e), attempts + getattr(e, "attempts", 1),
                               server.url, self._clock.time())
            attempts += used
            if done.finish_reason == "content_filter":
                return Failure(sample.id, sample.fingerprint, sample.category, sample.partition,
                               "content_filter", "the server's content filter stopped the "
                               "answer", attempts, server.url, self._clock.time())
            turns.append(done)
            # A truncated reply ends the chain: the next user turn would answer a cut-off text.
            if not followups or done.finish_reason == "length":
                break
            messages.append({"role": "assistant", "content": done.content})
            messages.append({"role": "user", "content": followups[0]})
            room = later_turn_room(done, messages[-1]["content"], self._context)
            wanted = sample.max_tokens
            if room is not None and room < wanted:
                if not self._shorten or room < MIN_ANSWER_TOKENS:
                    break  # it cannot go as asked: the chain ends with the turns that fit
                max_tokens = room
            else:
                max_tokens = None
            followups.pop(0)
            flight.next_turn()
        # Through a gateway, the worker that served the last turn (the one the answer names).
        worker = turns[-1].served_by or server.url
        return Record(sample.id, sample.fingerprint, sample.category, sample.partition,
                      sample.messages, sample.followups, tuple(turns), worker, attempts,
                      self._clock.time(), server_config=self._server_config(worker),
                      gateway=server.route.gateway if server.route else None)

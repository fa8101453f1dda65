"""Before the first request: wait for a server to answer, then fit the plan to its context.

Nothing is sent blind. Start-up waits, under the job's own timeouts and saying what it
waits for, until a server answers (a 671B model takes many minutes to load); it gives up
after `server_down_give_up_s` like a run whose servers all went down. The context length
and the servers' own prompt counts are kept in the manifest (`context`), so a later run
that reaches no server — or sends nothing — decides exactly as this one did: the plan does
not change with whether a server was reachable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from draftgen.client import ChatClient
from draftgen.client.context import context_length, prompt_tokens
from draftgen.clock import Clock
from draftgen.errors import RequestError
from draftgen.job import JobSpec
from draftgen.planning.plan import Plan
from draftgen.planning.replan import fit_context, near_context
from draftgen.sample import Sample

# How often start-up says what it is still waiting for.
SAY_EVERY_S = 10.0
# Prompt counts asked of a server at once.
COUNT_CONCURRENCY = 8


class Fitted(NamedTuple):
    """The plan fitted to the context, the samples to send, and what to record of it."""

    plan: Plan
    todo: list[Sample]
    context: dict[str, Any]


@dataclass(slots=True)
class StartUp:
    job: JobSpec
    client: ChatClient
    clock: Clock
    say: Callable[[str], None]
    # Per URL: its context length (None: it answered without saying).
    contexts: dict[str, int | None] = field(default_factory=dict)

    async def await_servers(self, urls: list[str],
                            known: Mapping[str, int] | None = None) -> str | None:
        """Wait until at least one of `urls` answers; each reading is bounded by the job's
        probe_timeout_s. Returns why it gave up (server_down_give_up_s), or None. `known`:
        context lengths learnt otherwise, by URL (a gateway's, from its relayed workers),
        for a URL that answers without saying one."""
        timeouts = self.job.client
        started = self.clock.monotonic()
        said = float("-inf")
        delay = 1.0
        while True:
            why: dict[str, str] = {}
            for url in urls:
                try:
                    self.contexts[url] = await context_length(
                        self.client, url, timeout_s=timeouts.probe_timeout_s)
                except RequestError as e:
                    why[url] = str(e)
            if len(why) < len(urls):
                for url, n in (known or {}).items():
                    if url in self.contexts and url not in why:
                        self.contexts[url] = min(self.contexts[url] or n, n)
                return None
            waited = self.clock.monotonic() - started
            if timeouts.server_down_give_up_s is not None and (
                    waited >= timeouts.server_down_give_up_s):
                return (f"no server answered for {waited:.0f}s (server_down_give_up_s): "
                        + "; ".join(f"{u}: {w}" for u, w in why.items()))
            if self.clock.monotonic() - said >= SAY_EVERY_S:
                said = self.clock.monotonic()
                self.say(f"waiting for a server to answer ({waited:.0f}s so far): "
                         + "; ".join(f"{u}: {w}" for u, w in why.items()))
            await self.clock.sleep(delay)
            delay = min(delay * 2, SAY_EVERY_S)

    async def fit(self, plan: Plan, todo: list[Sample], *, saved: Mapping[str, Any],
                  done: set[str], quiet: bool = False) -> Fitted:
        """The plan and the samples to send, fitted to the smallest context a server
        reports (else the one recorded by an earlier run); and what to record of it.
        `quiet`: a first look, before any server was asked."""
        known = [n for n in self.contexts.values() if n]
        context = min(known) if known else saved.get("tokens")
        if not isinstance(context, int):
            if todo and self.contexts:
                self.say("warning: no server reports its context length; prompts are not "
                         "checked against it")
            return Fitted(plan, todo, {})
        counts: dict[str, int] = {}
        if saved.get("tokens") == context:
            counts.update(saved.get("prompt_tokens") or {})
        exact = plan.token_count_label.startswith("tokenizer")
        ask = [s for s in near_context(todo, context, exact=exact) if s.id not in counts]
        if ask:  # a job tokenizer counts no chat template: near the limit the server decides
            counts.update(await self._count(ask))
        plan, todo, shortened = fit_context(plan, todo, context, counts=counts, keep=done,
                                            policy=self.job.over_context)
        set_aside = sum(r.reason.startswith("prompt_too_long") for r in plan.rejected)
        if (shortened or set_aside) and not quiet:
            self.say(f"context {context} tokens: {set_aside} prompt(s) set aside as too long, "
                     f"{shortened} sent with a smaller max_tokens (over_context: "
                     f"{self.job.over_context})")
        return Fitted(plan, todo, {"tokens": context, "prompt_tokens": counts})

    async def _count(self, samples: list[Sample]) -> dict[str, int]:
        """The servers' own prompt counts (template included) for `samples`."""
        url = next((u for u, n in self.contexts.items() if n), None)
        if url is None:
            return {}
        gate = asyncio.Semaphore(COUNT_CONCURRENCY)
        self.say(f"counting {len(samples)} long prompt(s) by {url}'s own count …")

        async def one(s: Sample) -> tuple[str, int | None]:
            messages = [*s.messages, *({"role": "user", "content": f} for f in s.followups)]
            async with gate:
                try:
                    # A count may be a one-token completion waiting behind a busy
                    # server's queue: as long as any request may wait for its first byte.
                    n = await prompt_tokens(self.client, url, self.job.model, messages,
                                            timeout_s=self.job.client.idle_timeout_s)
                except RequestError:
                    return s.id, None
            return s.id, n

        found = await asyncio.gather(*(one(s) for s in samples))
        if missed := sum(n is None for _, n in found):
            self.say(f"warning: {missed} long prompt(s) could not be counted by {url}: "
                     "fitted by the plan's estimate")
        return {sid: n for sid, n in found if n is not None}

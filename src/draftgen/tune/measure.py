"""One trial: launch a candidate, verify it, probe it, measure the job's requests on it.

    apply the levers → the quality policy → start (preflight) → wait for a real generation
    → verify what it runs with (KV tokens, KV dtype, headroom) → probe it against the
    recorded reference (first rung only) → a window of the job's own requests → stop

Whatever goes wrong becomes the trial's status and reason, never an exception: a refused
lever or a lossy dtype the policy does not allow is `refused` (nothing started), an engine
that dies on its flags or runs out of memory is `failed` (with the line of its log that
says why), a candidate whose outputs drift past the thresholds is `rejected` — measured all
the same, so the table shows what the loss would have bought.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from draftgen.clock import REAL_CLOCK, Clock
from draftgen.errors import DiskError, DraftgenError, JobError, RequestError
from draftgen.planning.calibrate import capacity_of
from draftgen.probe.drift import ProbeThresholds
from draftgen.probe.servers import ProbeError
from draftgen.sample import Message, Sample
from draftgen.schedule.load import LoadPoller
from draftgen.servers.base import ServerInfoError
from draftgen.servers.gpu import min_headroom_gib
from draftgen.servers.launcher import LaunchError, averify, start, stop, wait_ready
from draftgen.servers.policy import QualityPolicyError, check_profile
from draftgen.servers.profile import ServerProfile
from draftgen.tune.candidates import Candidate
from draftgen.tune.levers import apply_levers
from draftgen.tune.referee import load_reference, probe_against, probe_summary, record_reference
from draftgen.tune.store import Status, Trial, TuneDir
from draftgen.tune.window import measure_window


@dataclass(frozen=True)
class MeasureSettings:
    reference: ServerProfile
    tune_dir: TuneDir
    model: str  # the name the job's requests use
    samples: Sequence[Sample]
    base: Mapping[str, Any]  # the job's shared request fields
    concurrency: Mapping[str, int]
    probe_prompts: Sequence[Sequence[Message]]
    probe_max_tokens: int = 32
    probe_top_k: int = 10
    thresholds: ProbeThresholds = field(default_factory=ProbeThresholds)
    warmup_s: float = 5.0
    launch_timeout_s: float = 1800.0
    api_key: str | None = None
    clock: Clock = REAL_CLOCK
    on_event: Callable[[str], None] | None = None


def launch_profile(profile: ServerProfile, cand: Candidate, tune_dir: TuneDir) -> ServerProfile:
    """The candidate with the tune's bookkeeping: its own state folder, a free port."""
    launched = profile.model_copy(update={"name": f"tune-{cand.id}",
                                          "state_dir": str(tune_dir.servers), "port": 0})
    launched._source_file = profile.source_file
    return launched


def launch_reason(error: BaseException) -> str:
    """The first line, and the line of the engine's log that names the error."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if not lines:
        return type(error).__name__
    telling = [ln for ln in lines[1:] if any(w in ln for w in ("Error", "error:", "rror "))]
    return lines[0] + (f": {telling[-1][-240:]}" if telling else "")


class Measurer:
    """The `measure` of the search: one candidate at one rung, as a `Trial`."""

    def __init__(self, settings: MeasureSettings) -> None:
        self.s = settings

    def _say(self, text: str) -> None:
        if self.s.on_event is not None:
            self.s.on_event(text)

    async def __call__(self, cand: Candidate, rung: int, seconds: float) -> Trial:
        clock = self.s.clock
        t0 = clock.monotonic()
        fields: dict[str, Any] = {}
        status: Status = "measured"
        reason = ""
        try:
            status, reason = await self._run(cand, rung, seconds, fields)
        except DiskError:
            raise  # the tune directory, not the candidate: nothing can be recorded
        except (JobError, QualityPolicyError) as e:
            status, reason = "refused", str(e).split("\n\n")[0]
        except LaunchError as e:
            text = str(e)
            status = "refused" if text.startswith("preflight:") else "failed"
            reason = launch_reason(e)
        except (ServerInfoError, ProbeError, RequestError, DraftgenError) as e:
            status, reason = "failed", f"{type(e).__name__}: {e}".split("\n")[0][:300]
        trial = Trial(candidate=cand.id, rung=rung, levers=cand.levers.changes(),
                      origin=cand.origin, status=status, reason=reason, seconds=seconds,
                      cost_s=clock.monotonic() - t0, finished_at=clock.time(), **fields)
        self._say(f"  {cand.label} (rung {rung}): {status}"
                  + (f" — {reason}" if reason else
                     f", {trial.tok_s or 0:,.1f} tok/s, {trial.kv_tokens or 0:,} KV tokens"))
        return trial

    async def _run(self, cand: Candidate, rung: int, seconds: float,
                   fields: dict[str, Any]) -> tuple[Status, str]:
        s = self.s
        profile = apply_levers(s.reference, cand.levers)
        check_profile(profile)
        launched = launch_profile(profile, cand, s.tune_dir)
        await asyncio.to_thread(stop, launched)  # what a killed tune may have left running
        self._say(f"{cand.label} (rung {rung}): launching")
        started = s.clock.monotonic()
        handle = await asyncio.to_thread(start, launched, port=0)
        try:
            await asyncio.to_thread(wait_ready, handle, s.launch_timeout_s)
            fields["launch_s"] = round(s.clock.monotonic() - started, 1)
            verified = await averify(handle, launched)
            cap = capacity_of(verified.info)
            fields.update(
                kv_tokens=cap.kv_tokens, block_size=cap.block_size,
                max_running=cap.max_running or profile.max_running_requests,
                kv_dtype=verified.info.kv_dtype, summary=verified.summary,
                headroom_gib=min_headroom_gib(verified.gpus))
            status, reason = await self._probe(cand, rung, handle.url, fields)
            async with aiohttp.ClientSession() as session:
                poller = LoadPoller(session, handle.url, clock=s.clock)
                window = await measure_window(handle.url, s.samples, s.base, s.concurrency,
                                              seconds=seconds, warmup_s=s.warmup_s,
                                              api_key=s.api_key, clock=s.clock,
                                              load=poller.poll)
        finally:
            await asyncio.to_thread(stop, handle.dir)
        speed = window.speed()
        fields.update(tok_s=round(window.tok_s, 2), completed=window.completed,
                      lengths=window.lengths,
                      load={"kv_peak": window.kv_peak, "running_peak": window.running_peak,
                            "waiting_peak": window.waiting_peak,
                            "preempted": window.preempted},
                      speed=[[round(b, 3), round(r, 3)] for b, r in speed.points]
                      if speed else None)
        if window.tok_s <= 0 and status == "measured":
            why = "; ".join(window.errors) or "no output tokens in the window"
            return "failed", f"measure: {why}"
        return status, reason

    async def _probe(self, cand: Candidate, rung: int, url: str,
                     fields: dict[str, Any]) -> tuple[Status, str]:
        s = self.s
        path = s.tune_dir.reference_probe
        if cand.is_reference:
            if rung == 0 or load_reference(path) is None:
                self._say("  recording the reference's probe answers")
                recorded = await record_reference(
                    url, s.probe_prompts, model=s.model, max_tokens=s.probe_max_tokens,
                    top_k=s.probe_top_k, api_key=s.api_key)
                recorded.save(path)
            return "measured", ""
        if rung > 0:
            return "measured", ""  # the first rung's verdict stands
        reference = load_reference(path)
        if reference is None:
            raise ProbeError(f"no recorded reference in {path}")
        self._say("  probing against the reference")
        result = await probe_against(reference, url, thresholds=s.thresholds,
                                     api_key=s.api_key)
        fields["probe"] = probe_summary(result)
        if result.passed:
            return "measured", ""
        return "rejected", "probe: " + "; ".join(result.failures)

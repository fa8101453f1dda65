"""One trial: launch a candidate, verify it, probe it, measure the job's requests on it.

    apply the levers → the quality policy → start (preflight) → wait for a real generation
    → verify what it runs with (KV tokens, KV dtype, headroom) → probe it against the
    recorded reference (first rung only) → a window of the job's own requests → stop

Whatever goes wrong becomes the trial's status and reason, never an exception: a refused
lever or a lossy dtype the policy does not allow is `refused` (nothing started), and so is
a setting the engine itself refuses on this machine or build as it starts ("engine refused:
FP8 KV cache on CPU requires x86 with AVX-512 or AMX": `engine_refusal`), an engine that
dies otherwise on its flags or runs out of memory is `failed` (with the line of its log that
says why), a candidate whose outputs drift past the thresholds is `rejected` — measured all
the same, so the table shows what the loss would have bought. A window that got no output
tokens, or whose failed requests passed FAILED_SHARE of those that ended in it, is `failed`
("3 of 41 requests failed: <the first error>"): a configuration that drops requests is no
faster, whatever its tok/s.

Every server is asked with the job's API key, else the one the profile launches it with.
One that refuses the key while starting stops the tune (`JobError`): no candidate can be
measured, and nothing is recorded. No key reaches a trial: every reason is redacted
(`errors.redact`) of the job's key and the launch's secrets.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen.client.http import open_session
from draftgen.client.load import LoadPoller
from draftgen.clock import REAL_CLOCK, Clock
from draftgen.engines.info import ServerInfoError
from draftgen.engines.registry import engine_for
from draftgen.engines.scoring import ProbeError
from draftgen.errors import DiskError, DraftgenError, JobError, RequestError, redact
from draftgen.planning.calibrate import capacity_of
from draftgen.probe.drift import ProbeThresholds
from draftgen.probe.gate import GateSettings
from draftgen.sample import Message, Sample
from draftgen.servers.gpu import min_headroom_gib
from draftgen.servers.keys import launch_key, launch_secrets
from draftgen.servers.launcher import (
    LOG_FILE,
    ApiKeyRefused,
    LaunchError,
    averify,
    start,
    stop,
    wait_ready,
)
from draftgen.servers.policy import QualityPolicyError, check_profile
from draftgen.servers.profile import ServerProfile
from draftgen.tune.candidates import Candidate
from draftgen.tune.directory import Status, Trial, TuneDir
from draftgen.tune.levers import apply_levers
from draftgen.tune.referee import load_reference, probe_against, probe_summary, record_reference
from draftgen.tune.window import Window, measure_window

# A window whose failed requests are more than this share of the requests that ended in it
# (finished or failed, the warmup included) fails its candidate.
FAILED_SHARE = 0.01


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
    # The decode and cache-read paths against the reference's noise (None: prefill only).
    gate: GateSettings | None = None
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


class EngineRefused(DraftgenError):
    """The engine would not start with the candidate's settings on this machine."""


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_log(path: Path, since: int, limit: int = 1 << 20) -> str:
    """What this launch wrote to the server's log (appended to across launches)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(since, f.tell() - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# An exception line of an engine's log, its type and message ("ValueError: ...").
_EXCEPTION_LINE = re.compile(r"\b(\w*(?:Error|Exception)): (.+)$")
# What an engine says when a setting cannot run on this machine or build at all ...
_UNSUPPORTED = re.compile(
    r"not supported|unsupported|not implemented|only supported|requires? (?:x86|avx|amx|"
    r"arm|a gpu|cuda|rocm|compute capability|sm_?\d|hardware)", re.IGNORECASE)
# ... unlike running out of memory, which a smaller setting or another machine may fix.
_MEMORY = re.compile(r"memory|\boom\b|gib|\bmib\b|insufficient", re.IGNORECASE)


def engine_refusal(error: BaseException, log: str = "") -> str | None:
    """The reason `engine refused: <what it said>` when an engine exited while starting
    because it cannot run the setting here (vLLM's CPU build: "FP8 KV cache on CPU
    requires x86 with AVX-512 or AMX"), else None.

    Read from the outcome, never from the machine's features: the engine is the authority
    on what it supports. The root cause is the first such exception in its log (what the
    engine's wrappers raise after it, "Engine core initialization failed", says nothing).
    A NotImplementedError counts whatever its message; memory errors never do. `log` is
    the engine's whole log where it can be read (the error holds only its tail).
    """
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if not lines or "exited" not in lines[0]:
        return None
    for line in [*log.splitlines(), *lines[1:]]:
        found = _EXCEPTION_LINE.search(line)
        if found is None:
            continue
        kind, message = found.groups()
        if _MEMORY.search(message) or "OutOfMemory" in kind:
            continue
        if kind == "NotImplementedError" or _UNSUPPORTED.search(message):
            return f"engine refused: {message.strip()[:240]}"
    return None


class Measurer:
    """The `measure` of the search: one candidate at one rung, as a `Trial`."""

    def __init__(self, settings: MeasureSettings) -> None:
        self.s = settings

    def _say(self, text: str) -> None:
        if self.s.on_event is not None:
            self.s.on_event(self._redact(text))

    def _redact(self, text: str) -> str:
        return redact(text, (*launch_secrets(self.s.reference), self.s.api_key))

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
        except ApiKeyRefused as e:
            # The job's key, not the candidate: no server of this tune would answer.
            raise JobError(self._redact(str(e))) from None
        except (JobError, QualityPolicyError) as e:
            status, reason = "refused", str(e).split("\n\n")[0]
        except EngineRefused as e:
            status, reason = "refused", str(e)
        except LaunchError as e:
            status = "refused" if str(e).startswith("preflight:") else "failed"
            reason = launch_reason(e)
        except (ServerInfoError, ProbeError, RequestError, DraftgenError) as e:
            status, reason = "failed", f"{type(e).__name__}: {e}".split("\n")[0][:300]
        reason = self._redact(reason)
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
        log_from = _log_size(launched.state_path / LOG_FILE)
        handle = await asyncio.to_thread(start, launched, port=0)
        # The job's key, else the one the profile launches the server with.
        key = s.api_key or launch_key(launched)
        try:
            try:
                await asyncio.to_thread(wait_ready, handle, s.launch_timeout_s, api_key=key)
            except ApiKeyRefused:
                raise
            except LaunchError as e:
                refusal = engine_refusal(e, _read_log(handle.log_path, log_from))
                if refusal is not None:
                    raise EngineRefused(refusal) from None
                raise
            fields["launch_s"] = round(s.clock.monotonic() - started, 1)
            verified = await averify(handle, launched, api_key=key)
            cap = capacity_of(verified.info)
            fields.update(
                kv_tokens=cap.kv_tokens, block_size=cap.block_size,
                max_running=cap.max_running or engine_for(profile.engine).running_limit(profile),
                kv_dtype=verified.info.kv_dtype, summary=verified.summary,
                headroom_gib=min_headroom_gib(verified.gpus))
            status, reason = await self._probe(cand, rung, handle.url, key, fields)
            async with open_session(key) as session:
                poller = LoadPoller(session, handle.url, clock=s.clock)
                window = await measure_window(handle.url, s.samples, s.base, s.concurrency,
                                              seconds=seconds, warmup_s=s.warmup_s,
                                              api_key=key, clock=s.clock,
                                              load=poller.poll)
        finally:
            await asyncio.to_thread(stop, handle.dir)
        speed = window.speed()
        fields.update(tok_s=round(window.tok_s, 2), completed=window.completed,
                      lengths=window.lengths, unfinished=window.unfinished,
                      load={"kv_peak": window.kv_peak, "running_peak": window.running_peak,
                            "waiting_peak": window.waiting_peak,
                            "preempted": window.preempted},
                      speed=[[round(b, 3), round(r, 3)] for b, r in speed.points]
                      if speed else None)
        failure = window_failure(window)
        if failure is not None and status == "measured":
            return "failed", failure
        return status, reason


    async def _probe(self, cand: Candidate, rung: int, url: str, key: str | None,
                     fields: dict[str, Any]) -> tuple[Status, str]:
        s = self.s
        path = s.tune_dir.reference_probe
        if cand.is_reference:
            if rung == 0 or load_reference(path) is None:
                self._say("  recording the reference's probe answers")
                recorded = await record_reference(
                    url, s.probe_prompts, model=s.model, max_tokens=s.probe_max_tokens,
                    top_k=s.probe_top_k, api_key=key)
                recorded.save(path)
            return "measured", ""
        if rung > 0:
            return "measured", ""  # the first rung's verdict stands
        reference = load_reference(path)
        if reference is None:
            raise ProbeError(f"no recorded reference in {path}")
        self._say("  probing against the reference")
        result = await probe_against(reference, url, thresholds=s.thresholds, api_key=key,
                                     gate=s.gate)
        fields["probe"] = probe_summary(result)
        if result.passed:
            return "measured", ""
        gate = list(result.gate.failures) if result.gate is not None else []
        return "rejected", "probe: " + "; ".join([*result.failures, *gate])


def window_failure(window: Window) -> str | None:
    """Why a window fails its candidate (see the module docstring), or None."""
    ended = window.completed + window.failed
    first = window.errors[0] if window.errors else "no message"
    if window.tok_s <= 0:
        if window.failed:
            return f"measure: no output tokens; {window.failed} of {ended} requests failed: " \
                   f"{first}"
        return "measure: no output tokens in the window"
    if window.failed > FAILED_SHARE * ended:
        return f"measure: {window.failed} of {ended} requests failed: {first}"
    return None

"""A run's servers: launch the embedded ones, verify every one against the quality policy,
record what each runs with, and stop what the run started.

A server whose KV cache is lossy is refused unless the profile it was launched from (or
that the job names for it) carries the override; the override is stamped into the run
manifest. A URL that answers like neither engine (a proxy, a test stand-in) or whose KV
dtype cannot be told is used but recorded as unverified, with a warning. A gateway's worker
whose own URL does not answer is verified from what the gateway relays of it (its metrics
and what it lists of it, gateways/relayed.py): what they do not say is unverified alike.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from draftgen.engines.info import ServerInfoError, configuration_id
from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.gateways.launch import LaunchedFleet, launch_gateway, launch_worker
from draftgen.gateways.profile import (
    GatewayProfile,
    gateway_of_workers,
    load_any_profile,
)
from draftgen.gateways.relayed import fetch_relayed_info
from draftgen.job import JobSpec
from draftgen.servers.info import fetch_server_info, manifest_record
from draftgen.servers.launcher import Verified, stop
from draftgen.servers.policy import check_profile, check_running
from draftgen.servers.process import find_free_port
from draftgen.servers.profile import ServerProfile, load_profile


def check_url(url: str, where: str) -> str:
    """`url` when it is an http(s) base URL; a JobError naming `where` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = f" (write http://{url})" if "://" not in url else ""
        raise JobError(f"{where}: {url!r} is not an http(s) URL{hint}")
    return url


@dataclass(slots=True)
class AttachedServers:
    job: JobSpec
    override_urls: list[str]
    state_dir: Path
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)
    api_key: str | None = field(default=None, repr=False)
    override_gateways: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    # Gateways whose workers the run finds (running/gateways.py), with the profile their
    # workers were started from, if the job names one.
    gateways: dict[str, ServerProfile | None] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    _profiles: dict[str, ServerProfile] = field(default_factory=dict)
    _identity: dict[str, Any] = field(default_factory=dict)
    _launched: list[ServerProfile] = field(default_factory=list)
    _fleets: list[LaunchedFleet] = field(default_factory=list)
    _engines: dict[str, str] = field(default_factory=dict)
    # Each server's configuration as last verified (id), and every configuration seen.
    _config_of: dict[str, str] = field(default_factory=dict)
    # Gateway workers reached only through their gateway: worker URL -> gateway.
    _relayed: dict[str, str] = field(default_factory=dict)
    configurations: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The running limit each server this run launched was started with (--max-num-seqs,
    # --max-running-requests): vLLM publishes none, and the scheduler need not learn it.
    launched_limits: dict[str, int] = field(default_factory=dict)

    async def __aenter__(self) -> AttachedServers:
        if self.override_urls or self.override_gateways:
            self.urls = [check_url(u, "--server").rstrip("/") for u in self.override_urls]
            self.gateways = {check_url(u, "--gateway").rstrip("/"): None
                             for u in self.override_gateways}
            return self
        try:
            for s in self.job.servers:
                if s.launch is not None:
                    launched = load_any_profile(self.job.resolve(s.launch))
                    if isinstance(launched, GatewayProfile):
                        await self._launch_gateway(launched)
                    else:
                        self.urls.append(await self._launch(launched))
                elif s.workers is not None:
                    await self._launch_gateway(gateway_of_workers(
                        [load_profile(self.job.resolve(p)) for p in s.workers],
                        name=self._gateway_name(), where="servers"))
                elif s.gateway is not None:
                    self.gateways[check_url(s.gateway, "servers")] = (
                        load_profile(self.job.resolve(s.profile)) if s.profile else None)
                else:
                    assert s.url is not None
                    self.urls.append(check_url(s.url, "servers"))
                    if s.profile is not None:
                        self._profiles[s.url] = load_profile(self.job.resolve(s.profile))
        except BaseException:
            self.stop_launched()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop_launched)

    async def _launch_gateway(self, profile: GatewayProfile) -> None:
        """Launch the workers side by side, then a gateway in front of them, on free ports,
        under the run's servers folder (`gateway_launch.py`, as `serve` does); its workers are
        found through it like any gateway's, each keeping its own profile."""
        for worker in profile.workers:
            check_profile(worker)
        fleet = await launch_gateway(profile, folder=self.state_dir / profile.server_name,
                                     free_ports=True, launch_one=self._launch_worker,
                                     log=self.log)
        self._fleets.append(fleet)
        self.gateways[fleet.gateway.url] = None

    def _gateway_name(self) -> str:
        """A folder under the run's servers folder for a `workers:` entry's gateway."""
        taken = len(self._fleets)
        return "gateway" if not taken else f"gateway-{taken + 1}"

    async def _launch(self, profile: ServerProfile) -> str:
        check_profile(profile)
        # Under the run directory, on a free port: a run never collides with a server the
        # user started from the same profile by hand.
        profile = profile.model_copy(update={"state_dir": str(self.state_dir)})
        verified = await self._launch_worker(profile, find_free_port())
        return verified.handle.url

    async def _launch_worker(self, profile: ServerProfile, port: int | None) -> Verified:
        """Launch and verify one server; cancelled, it stops the half-started server."""
        self.log(f"launching {profile.engine} from {profile.source_file} on port {port} …")
        self._launched.append(profile)
        verified = await launch_worker(profile, port, api_key=self.api_key)
        self.log(verified.summary)
        self._profiles[verified.handle.url] = profile
        if (limit := engine_for(profile.engine).running_limit(profile)) is not None:
            self.launched_limits[verified.handle.url] = limit
        return verified

    def worker_of(self, gateway: str, url: str, *, relayed: bool = False) -> None:
        """`url` is a worker behind `gateway`: the profile the job names for the gateway's
        workers applies to it (a worker the run launched keeps its own). `relayed`: its own
        URL does not answer, so it is verified from what the gateway relays of it."""
        if (profile := self.gateways.get(gateway)) is not None:
            self._profiles.setdefault(url, profile)
        if relayed:
            self._relayed[url] = gateway

    def relayed_contexts(self) -> dict[str, int]:
        """Per gateway, the smallest context length its relayed workers were verified with
        (what start-up cannot ask the gateway: its /v1/models does not say)."""
        out: dict[str, int] = {}
        for r in self.records:
            gateway, n = self._relayed.get(r["url"]), r.get("context_length")
            if gateway is not None and isinstance(n, int):
                out[gateway] = min(n, out.get(gateway, n))
        return out

    def configuration_of(self, url: str) -> str | None:
        """The id of the configuration `url` was last verified with (None: unverified)."""
        return self._config_of.get(url)

    def request_fields(self, url: str) -> Mapping[str, Any]:
        """Fields every request to `url` carries for its engine (token ids); none while the
        engine is unknown, since one engine's field must never reach another."""
        engine = self._engines.get(url)
        return engine_for(engine).token_id_fields if engine else {}

    def stop_launched(self) -> None:
        while self._fleets:
            self._fleets.pop().stop()
        while self._launched:
            stop(self._launched.pop())

    async def verify(self, url: str) -> dict[str, Any] | None:
        """Record what `url` runs with; raises QualityPolicyError for a refused server.
        Returns the record when it is new (first check, or the server changed)."""
        profile = self._profiles.get(url)
        limit = self.job.client.probe_timeout_s
        try:
            async with asyncio.timeout(limit):
                info = await (
                    fetch_relayed_info(self._relayed[url], url, profile=profile,
                                       api_key=self.api_key) if url in self._relayed
                    else fetch_server_info(url, profile=profile, api_key=self.api_key))
        except (ServerInfoError, TimeoutError) as e:
            reason = str(e) or f"{url} did not describe itself within {limit:g}s"
            record: dict[str, Any] = {"url": url, "verified": False, "reason": reason}
            identity: Any = None
            # Whatever answers now is unknown: no configuration, no engine-specific fields.
            self._config_of.pop(url, None)
            self._engines.pop(url, None)
        else:
            identity = info.identity()
            self._engines[url] = info.engine
            configuration = info.configuration()
            cid = configuration_id(configuration)
            self._config_of[url] = cid
            self.configurations[cid] = configuration
            if info.kv_dtype is None:
                record = {**manifest_record(info, profile=profile), "verified": False,
                          "reason": f"KV dtype unknown: {info.kv_dtype_note}"}
            else:
                stamp = check_running(info, profile)
                record = {**manifest_record(info, profile=profile, quality_stamp=stamp),
                          "verified": True}
        if url in self._identity and self._identity[url] == identity:
            return None
        # A server unreachable at its first check did not change when it first answers.
        changed = self._identity.get(url) is not None
        self._identity[url] = identity
        if not record["verified"]:
            self.log(f"warning: {url}: quality policy not verified ({record['reason']})")
        if record.get("seeds_honoured") is False and self.job.sampling.seed is not None:
            name = engine_for(str(record["engine"])).display_name
            self.log(f"warning: {url}: per-sample seeds ignored by this engine ({name} without "
                     "--enable-deterministic-inference; profile: deterministic_inference: true)")
        self.records.append(record)
        return {**record, "changed_mid_run": changed}

"""A run's servers: launch the embedded ones, verify every one against the quality policy,
record what each runs with, and stop what the run started.

A server whose KV cache is lossy is refused unless the profile it was launched from (or
that the job names for it) carries the override; the override is stamped into the run
manifest. A URL that answers like neither engine (a proxy, a test stand-in) or whose KV
dtype cannot be told is used but recorded as unverified, with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from draftgen.errors import JobError
from draftgen.job import JobSpec
from draftgen.servers.engines.info import ServerInfoError, configuration_id
from draftgen.servers.engines.registry import engine_for
from draftgen.servers.gateway import LaunchedGateway
from draftgen.servers.info import fetch_server_info, manifest_record
from draftgen.servers.launcher import launch, stop
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
    _gateways_started: list[LaunchedGateway] = field(default_factory=list)
    _engines: dict[str, str] = field(default_factory=dict)
    # Each server's configuration as last verified (id), and every configuration seen.
    _config_of: dict[str, str] = field(default_factory=dict)
    configurations: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def __aenter__(self) -> AttachedServers:
        if self.override_urls or self.override_gateways:
            self.urls = [check_url(u, "--server").rstrip("/") for u in self.override_urls]
            self.gateways = {check_url(u, "--gateway").rstrip("/"): None
                             for u in self.override_gateways}
            return self
        try:
            for s in self.job.servers:
                if s.launch is not None:
                    self.urls.append(await self._launch(load_profile(self.job.resolve(s.launch))))
                elif s.workers is not None:
                    await self._launch_gateway(s.workers)
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

    async def _launch_gateway(self, worker_profiles: list[str]) -> None:
        """Launch each worker profile, then a gateway in front of them (its log under the
        run's servers folder); its workers are found through it like any gateway's."""
        profiles = [load_profile(self.job.resolve(p)) for p in worker_profiles]
        if len({p.engine for p in profiles}) > 1:
            raise JobError(f"servers: workers {worker_profiles} mix engines "
                           f"({', '.join(sorted({p.engine for p in profiles}))}); a gateway "
                           "fronts one kind")
        urls = [await self._launch(p) for p in profiles]
        gateway = LaunchedGateway(urls, backend=profiles[0].engine,
                                  log_path=self.state_dir / "gateway.log")
        self._gateways_started.append(gateway)
        self.log(f"launching a gateway in front of {len(urls)} workers on {gateway.url} …")
        await asyncio.to_thread(gateway.start)
        self.gateways[gateway.url] = None  # each worker keeps its own profile

    async def _launch(self, profile: ServerProfile) -> str:
        check_profile(profile)
        # Under the run directory, on a free port: a run never collides with a server the
        # user started from the same profile by hand.
        profile = profile.model_copy(update={"state_dir": str(self.state_dir)})
        port = find_free_port()
        self.log(f"launching {profile.engine} from {profile.source_file} on port {port} …")
        self._launched.append(profile)
        cancelled = threading.Event()

        def on_wait(_elapsed_s: float) -> None:
            # Raised inside the launching thread, so `launch` stops the half-started server.
            if cancelled.is_set():
                raise KeyboardInterrupt

        attempt = asyncio.ensure_future(asyncio.to_thread(launch, profile, port=port,
                                                          on_wait=on_wait,
                                                          api_key=self.api_key))
        try:
            verified = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            cancelled.set()
            with contextlib.suppress(BaseException):
                await attempt
            raise
        self.log(verified.summary)
        self._profiles[verified.handle.url] = profile
        return verified.handle.url

    def worker_of(self, gateway: str, url: str) -> None:
        """`url` is a worker behind `gateway`: the profile the job names for the gateway's
        workers applies to it (a worker the run launched keeps its own)."""
        if (profile := self.gateways.get(gateway)) is not None:
            self._profiles.setdefault(url, profile)

    def configuration_of(self, url: str) -> str | None:
        """The id of the configuration `url` was last verified with (None: unverified)."""
        return self._config_of.get(url)

    def request_fields(self, url: str) -> Mapping[str, Any]:
        """Fields every request to `url` carries for its engine (token ids); none while the
        engine is unknown, since one engine's field must never reach another."""
        engine = self._engines.get(url)
        return engine_for(engine).token_id_fields if engine else {}

    def stop_launched(self) -> None:
        while self._gateways_started:
            self._gateways_started.pop().stop()
        while self._launched:
            stop(self._launched.pop())

    async def verify(self, url: str) -> dict[str, Any] | None:
        """Record what `url` runs with; raises QualityPolicyError for a refused server.
        Returns the record when it is new (first check, or the server changed)."""
        profile = self._profiles.get(url)
        limit = self.job.client.probe_timeout_s
        try:
            async with asyncio.timeout(limit):
                info = await fetch_server_info(url, profile=profile, api_key=self.api_key)
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

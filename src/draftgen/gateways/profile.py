"""A gateway profile: worker server profiles and the SGLang Model Gateway (`smg`) in front of
them, launched, verified and stopped as one (`draftgen serve`, or a job's `launch:`).

    name: local-cpu-gateway        # its folder under the state directory (default: file stem)
    gateway:
      workers: [local-cpu-worker-0.yaml, local-cpu-worker-1.yaml]  # relative to this file
      host: 127.0.0.1
      port: 30000                  # 0: a free port at start
      metrics_port: 0              # smg's Prometheus port; 0: a free one at start
      python: ../../.venv/bin/python   # the interpreter with smg; default: draftgen's

A file is a gateway profile when it has a `gateway:` section, else a server profile. Like a
server profile, unknown keys and bad values are one `JobError` naming the file and field; a
worker's own problem names the gateway profile, the field (`gateway.workers.N`) and the
worker's file. Workers must run one engine (a gateway fronts one kind), live in distinct
folders and not be given one fixed port twice.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from draftgen.engines.registry import engine_for
from draftgen.errors import JobError
from draftgen.servers.profile import (
    NAME_PATTERN,
    ServerProfile,
    default_state_dir,
    load_profile,
    profile_hash,
    resolve_relative,
)
from draftgen.yamlfile import load_model, load_yaml

WORKERS_DIR = "workers"
_WHAT = "gateway profile"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GatewaySettings(_Strict):
    # Server profiles, relative to the gateway profile's file.
    workers: list[str] = Field(min_length=1)
    host: str = "127.0.0.1"
    # smg's own default; 0: a free port at start.
    port: int = Field(default=30000, ge=0, le=65535)
    # smg's Prometheus listener (its default, 29000 on every interface, collides with a
    # second gateway); 0: a free port at start.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # The interpreter that runs `-m smg`; default: the one running draftgen.
    python: str | None = None

    @model_validator(mode="after")
    def _distinct(self) -> GatewaySettings:
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("workers: a profile is listed twice")
        if self.port and self.port == self.metrics_port:
            raise ValueError(f"metrics_port: {self.metrics_port} is the gateway's own port")
        return self


class GatewayProfile(_Strict):
    gateway: GatewaySettings
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    # Where its folder goes; default ~/.cache/draftgen/servers (as for a server).
    state_dir: str | None = None

    _source_file: Path | None = PrivateAttr(default=None)
    _workers: tuple[ServerProfile, ...] = PrivateAttr(default=())

    @property
    def source_file(self) -> Path | None:
        return self._source_file

    @property
    def workers(self) -> tuple[ServerProfile, ...]:
        """The workers as their files say (their own state folders)."""
        return self._workers

    @property
    def server_name(self) -> str:
        if self.name:
            return self.name
        return self._source_file.stem if self._source_file is not None else "gateway"

    @property
    def state_path(self) -> Path:
        return (Path(self.state_dir) if self.state_dir else default_state_dir()) / self.server_name

    @property
    def interpreter(self) -> str:
        return self.gateway.python or sys.executable

    @property
    def backend(self) -> str:
        """The engine every worker runs (checked at load), as smg's `--backend` names it."""
        return self._workers[0].engine

    def workers_in(self, folder: Path) -> list[ServerProfile]:
        """The workers with their state under `folder/workers/<name>/`: the gateway owns them,
        and a worker served on its own from the same file keeps its folder."""
        return [w.model_copy(update={"state_dir": str(folder / WORKERS_DIR)})
                for w in self._workers]


def gateway_profile_hash(profile: GatewayProfile) -> str:
    """Same hash, same gateway settings and same worker settings (each `profile_hash`)."""
    data = {"gateway": profile.gateway.model_dump(mode="json", exclude={"workers"}),
            "workers": [profile_hash(w) for w in profile.workers]}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_gateway_profile(path: str | Path) -> bool:
    """Whether the file reads as a gateway profile (a mapping with a `gateway:` section)."""
    raw = load_yaml(Path(path), "server profile")
    return isinstance(raw, dict) and "gateway" in raw


def load_any_profile(path: str | Path) -> ServerProfile | GatewayProfile:
    """A gateway profile or a server profile, whichever the file is."""
    return load_gateway_profile(path) if is_gateway_profile(path) else load_profile(path)


def load_gateway_profile(path: str | Path) -> GatewayProfile:
    """Read and validate a gateway profile and each worker profile it names."""
    p = Path(path)
    profile = load_model(p, GatewayProfile, _WHAT)
    base = p.resolve().parent
    update: dict[str, Any] = {}
    if profile.state_dir:
        update["state_dir"] = resolve_relative(profile.state_dir, base)
    python = profile.gateway.python
    if python and "/" in python:  # a bare name is looked up on PATH
        update["gateway"] = profile.gateway.model_copy(
            update={"python": resolve_relative(python, base)})
    resolved = profile.model_copy(update=update)
    resolved._source_file = p.resolve()
    workers = []
    for i, worker in enumerate(profile.gateway.workers):
        where = f"{p}: invalid {_WHAT}: gateway.workers.{i}"
        worker_path = base / Path(worker).expanduser()
        if worker_path.is_file() and is_gateway_profile(worker_path):
            raise JobError(f"{where}: {worker} is a gateway profile; a worker is a server "
                           "profile")
        try:
            workers.append(load_profile(worker_path))
        except JobError as e:
            raise JobError(f"{where}: {e}") from None
    resolved._workers = tuple(workers)
    _check_workers(p, workers)
    return resolved


def gateway_of_workers(workers: Sequence[ServerProfile], *, name: str,
                       where: str) -> GatewayProfile:
    """A gateway profile for workers already loaded (a job's `workers:` entry): default
    settings, every port free; `where` names the entry in messages."""
    # Ports are not checked: a run launches every worker on a free port.
    _check_workers(where, list(workers), prefix="", ports=False)
    profile = GatewayProfile(name=name, gateway=GatewaySettings(
        workers=[str(w.source_file or w.server_name) for w in workers], port=0))
    profile._workers = tuple(workers)
    return profile


def _check_workers(where: str | Path, workers: list[ServerProfile],
                   prefix: str = f": invalid {_WHAT}: gateway.workers", ports: bool = True
                   ) -> None:
    engines = sorted({w.engine for w in workers})
    if len(engines) > 1:
        raise JobError(f"{where}{prefix}: workers mix engines ({', '.join(engines)}); a gateway "
                       "fronts one kind")
    names: dict[str, ServerProfile] = {}
    taken: dict[tuple[str, int], ServerProfile] = {}
    for w in workers:
        if (other := names.get(w.server_name)) is not None:
            raise JobError(f"{where}{prefix}: {other.source_file} and {w.source_file} are both "
                           f"named {w.server_name!r}; give each worker its own `name`")
        names[w.server_name] = w
        engine = engine_for(w.engine)
        port = engine.port(w)
        if not ports or not port:
            continue
        if (other := taken.setdefault((engine.connect_host(w), port), w)) is not w:
            raise JobError(f"{where}{prefix}: {other.source_file} and {w.source_file} both "
                           f"listen on port {port}; give each its own (or port: 0)")

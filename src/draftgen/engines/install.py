"""Which engine a profile's interpreter has: its version and the flags its own argument
parser defines, read from the installed files without importing the engine.

Flags move between releases (SGLang 0.5.23 deprecates `--enable-dp-attention` for
`--attn-dp-size`), so the launch argv is chosen from what the installed engine knows, not
from a version table. The engine's own parser is asked where it imports (the machine that
runs it); elsewhere (a laptop preparing a launch, a CPU-only test) the files that declare
its options are read as text: quoted option strings, and 0.5.23's annotated option fields.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from functools import cache

# Run with the profile's interpreter: the engine may live in another environment than
# draftgen. Prints {"version": ..., "flags": [...] or null} for the first distribution found.
_PROBE = r"""
import argparse, importlib, json, re, sys
from importlib import metadata
found = {"version": None, "flags": None, "dist": None}
module, files = sys.argv[1], sys.argv[2].split(",")
for dist_name in sys.argv[3:]:
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        continue
    found["version"], found["dist"] = dist.version, dist_name
    try:  # the engine's own parser, where it imports here (a machine with its deps)
        if module:
            parser = argparse.ArgumentParser()
            importlib.import_module(module).ServerArgs.add_cli_args(parser)
            found["flags"] = sorted({o for a in parser._actions for o in a.option_strings})
            break
    except Exception:
        pass
    flags = set()
    for f in dist.files or []:
        name = str(f)
        if not any(name == p or (p.endswith("/") and name.startswith(p)) for p in files):
            continue
        if not name.endswith(".py"):
            continue
        try:
            text = open(dist.locate_file(f), encoding="utf-8").read()
        except OSError:
            continue
        flags.update(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)[\"']", text))
        # 0.5.23 declares options as annotated fields (`attn_dp_size: A[int, Arg(...)]`).
        flags.update("--" + n.replace("_", "-") for n in
                     re.findall(r"(?m)^\s+([a-z][a-z0-9_]*)\s*:\s*(?:A|Annotated)\[", text))
    found["flags"] = sorted(flags) if flags else None
    break
print(json.dumps(found))
"""

# Per engine (its `install_sources`): the module whose `ServerArgs.add_cli_args` builds its
# parser ("" where there is none to import), the files that declare its options (read as
# text where that module does not import, e.g. without a GPU stack), and the distributions
# it ships as.
@dataclass(frozen=True)
class InstallSources:
    module: str
    files: str
    dists: tuple[str, ...]


_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EngineInstall:
    """What is installed; every field None when the engine is not (or could not be read)."""

    engine: str
    interpreter: str
    version: str | None = None
    # Option strings the engine's server-argument module spells out; None: unknown.
    flags: frozenset[str] | None = None
    note: str = ""

    def has_flag(self, flag: str) -> bool | None:
        """Whether the installed engine knows `flag`; None when that cannot be told."""
        return None if self.flags is None else flag in self.flags

    def describe(self) -> str:
        if self.version is None:
            return f"{self.engine} not found for {self.interpreter}" + (
                f" ({self.note})" if self.note else "")
        return f"{self.engine} {self.version} ({self.interpreter})"


@cache
def detect_install(engine: str, sources: InstallSources, interpreter: str) -> EngineInstall:
    """The engine as `interpreter` sees it (cached: installs do not change during a run)."""
    try:
        done = subprocess.run([interpreter, "-c", _PROBE, sources.module, sources.files,
                               *sources.dists],
                              capture_output=True,
                              text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return EngineInstall(engine, interpreter, note=f"cannot run {interpreter}: {e}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return EngineInstall(engine, interpreter,
                             note=f"{interpreter} did not answer ({done.stderr.strip()[-200:]})")
    flags = found.get("flags")
    return EngineInstall(engine, interpreter, found.get("version"),
                         frozenset(flags) if isinstance(flags, list) else None)

"""The command-line app and what every command shares: loading a job, checking a URL or a
run directory before any work, printing JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import typer
from rich.console import Console

from draftgen.cli.errors import OneLineErrors, fail
from draftgen.errors import JobError, StoreError
from draftgen.job import JobSpec, load_job, url_problem

# Off a terminal (a log, a pipe) rich assumes 80 columns, which squeezes the tables.
out = Console(width=None if sys.stdout.isatty() else 120)

app = typer.Typer(add_completion=False, no_args_is_help=True, cls=OneLineErrors,
                  help="Generate training datasets from self-hosted LLM servers.")
engine_app = typer.Typer(no_args_is_help=True, help="The tiny local engine (a CPU build).")
app.add_typer(engine_app, name="engine")


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def load(job_file: Path) -> JobSpec:
    try:
        return load_job(job_file)
    except JobError as e:
        raise fail(e) from None


def check_url_option(url: str, where: str) -> None:
    """A server URL is checked before anything connects (or a plan is built)."""
    from draftgen.running.attach import check_url

    try:
        check_url(url, where)
    except JobError as e:
        raise fail(e) from None
    if (problem := url_problem(url)) is not None:
        raise fail(JobError(f"{where}: {problem}"))


def check_run_dir(out_dir: Path, *, planned: bool = True) -> None:
    """`out_dir` names a run directory (with `planned`, one a run has planned): readable as
    one, or the command stops here, before any work."""
    from draftgen.store.reading import check_run_dir, read_manifest

    try:
        check_run_dir(out_dir, planned=planned)
        read_manifest(out_dir)
    except StoreError as e:
        raise fail(e) from None


def print_json(obj: object) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")

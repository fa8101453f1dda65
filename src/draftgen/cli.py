"""The command line: parse, load the job, call one library function, print."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import orjson
import typer
from rich.console import Console
from rich.table import Table

from draftgen.cli_errors import OneLineErrors, fail
from draftgen.errors import DraftgenError, HostError, JobError, StoreError, path_error
from draftgen.job import JobSpec, load_job, read_api_key, url_problem

# Off a terminal (a log, a pipe) rich assumes 80 columns, which squeezes the tables.
_out = Console(width=None if sys.stdout.isatty() else 120)

app = typer.Typer(add_completion=False, no_args_is_help=True, cls=OneLineErrors,
                  help="Generate training datasets from self-hosted LLM servers.")
engine_app = typer.Typer(no_args_is_help=True, help="The tiny local engine (vLLM CPU).")
app.add_typer(engine_app, name="engine")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _load(job_file: Path) -> JobSpec:
    try:
        return load_job(job_file)
    except JobError as e:
        raise fail(e) from None


def _check_url(url: str, where: str) -> None:
    """A server URL is checked before anything connects (or a plan is built)."""
    from draftgen.servers.attach import check_url

    try:
        check_url(url, where)
    except JobError as e:
        raise fail(e) from None
    if (problem := url_problem(url)) is not None:
        raise fail(JobError(f"{where}: {problem}"))


def _run_dir(out_dir: Path, *, planned: bool = True) -> None:
    """`out_dir` names a run directory (with `planned`, one a run has planned): readable as
    one, or the command stops here, before any work."""
    from draftgen.store.reading import check_run_dir, read_manifest

    try:
        check_run_dir(out_dir, planned=planned)
        read_manifest(out_dir)
    except StoreError as e:
        raise fail(e) from None


def _json(obj: object) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")


@app.command()
def plan(
    job_file: Annotated[Path, typer.Argument(help="job YAML")],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
    server: Annotated[str | None, typer.Option(
        help="calibrate against this server and predict the run's duration")] = None,
    from_run: Annotated[Path | None, typer.Option(
        help="use the lengths and speed measured in this run directory")] = None,
    budget: Annotated[str | None, typer.Option(
        help="time budget (48h, 90m, 2d12h): propose per-category caps that fit")] = None,
    priority: Annotated[str | None, typer.Option(
        help="cap by priority instead of proportionally: categories, most important first, "
             "comma-separated")] = None,
    write_job: Annotated[Path | None, typer.Option(
        help="write a copy of the job with the proposed caps")] = None,
    kv_tokens: Annotated[int | None, typer.Option(
        min=1, help="what if each server had this many KV tokens")] = None,
    servers: Annotated[int | None, typer.Option(min=1, help="what if there were N servers")
                       ] = None,
) -> None:
    """Read every source, apply caps and dedup, and show what a run would generate; with
    --server or --from-run, how long it will take and what fits a --budget."""
    from draftgen.planning.forecast import parse_duration
    from draftgen.planning.plan import build_plan

    job = _load(job_file)
    # Every option is checked before the plan reads a single source row.
    what_if = (budget, priority, kv_tokens, servers, write_job)
    if server is None and from_run is None and any(o is not None for o in what_if):
        raise fail(JobError("--budget, --priority, --kv-tokens, --servers and --write-job "
                            "need --server URL or --from-run OUT"))
    if write_job is not None and budget is None:
        raise fail(JobError("--write-job needs --budget"))
    api_key = None
    if server is not None:
        _check_url(server, "--server")
        try:
            api_key = read_api_key(job)
        except JobError as e:
            raise fail(e) from None
    if from_run is not None:
        _run_dir(from_run)
    names = {c.name for c in job.categories}
    order = [c.strip() for c in (priority or "").split(",") if c.strip()]
    if unknown := [c for c in order if c not in names]:
        raise fail(JobError(f"--priority: {', '.join(map(repr, unknown))} is not a category "
                            f"of {job_file} ({', '.join(sorted(names))})"))
    try:
        budget_s = parse_duration(budget) if budget is not None else None
        if budget_s is not None and budget_s <= 0:
            raise JobError(f"--budget: {budget!r} is no time at all")
        p = build_plan(job)
    except DraftgenError as e:
        raise fail(e) from None
    rows = p.summary_rows()
    if as_json:
        _json({"rows": rows, "totals": p.totals(), "token_count": p.token_count_label,
               "rejected": [{"category": r.category, "source": r.source, "row": r.row,
                             "reason": r.reason} for r in p.rejected]})
    else:
        t = Table(title=f"plan for {job_file} (prompt tokens: {p.token_count_label})")
        cols = ["category", "partition", "prompts", "samples", "rejected", "duplicates",
                "capped", "prompt_tokens", "max_output_tokens"]
        for c in cols:
            t.add_column(c.replace("_", " "), justify="left" if c in cols[:2] else "right")
        for r in [*rows, p.totals()]:
            t.add_row(*(f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in cols),
                      style="bold" if r["category"] == "total" else None)
        _out.print(t)
    if server is None and from_run is None:
        return
    from draftgen.planning.forecast import forecast, measure

    try:
        measured = asyncio.run(measure(job, server=server, from_run=from_run,
                                       api_key=api_key))
        fc = forecast(job, p, measured, kv_tokens=kv_tokens, servers=servers,
                      budget_s=budget_s, mode="priority" if order else "proportional",
                      priority=order)
        for line in fc.lines():
            print(line)
        if write_job is not None:
            if fc.caps is None:
                raise JobError("--write-job needs --budget")
            from draftgen.planning.budget import write_job_with_caps

            print(f"wrote {write_job_with_caps(job_file, fc.caps.caps, write_job)}")
    except DraftgenError as e:
        raise fail(e) from None


@app.command()
def run(
    job_file: Annotated[Path, typer.Argument(help="job YAML")],
    server: Annotated[list[str] | None, typer.Option(help="server base URL (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option(help="output directory (default: the job's)")] = None,
    retry_failed: Annotated[bool, typer.Option(help="re-send samples recorded as failed")] = False,
    redo_changed: Annotated[bool, typer.Option(
        help="regenerate samples whose request changed since they were recorded")] = False,
    rerun_truncated: Annotated[bool, typer.Option(
        help="re-run truncated samples of partitions with `truncation: escalate`")] = False,
    redo_config: Annotated[list[str] | None, typer.Option(
        help="regenerate every sample made under this server configuration (an id that "
             "`status` lists; repeatable)")] = None,
    progress: Annotated[bool | None, typer.Option(
        help="live view (default: only on a terminal)")] = None,
    grace: Annotated[float, typer.Option(
        min=0, help="seconds in-flight requests get after a stop")] = 30,
    detach: Annotated[bool, typer.Option(
        help="run in the background; log and pid under the output directory")] = False,
    metrics_port: Annotated[int | None, typer.Option(
        min=0, max=65535, help="serve Prometheus metrics on 127.0.0.1:PORT (0: a free port)")
    ] = None,
) -> None:
    """Generate every pending sample of the job; safe to run again to resume."""
    from draftgen.running.runner import RunOptions, run_job

    job = _load(job_file)
    out_dir = out or job.resolve(job.output)
    for url in server or ():
        _check_url(url, "--server")
    if out_dir.exists():  # a file, or a run directory whose manifest is damaged, stops here
        _run_dir(out_dir, planned=False)
    # A read-only place for the run directory is the machine's problem: exit 1, before a plan.
    nearest = next(d for d in (out_dir, *out_dir.absolute().parents) if d.exists())
    if nearest.is_dir() and not os.access(nearest, os.W_OK | os.X_OK):
        raise fail(HostError(f"{'--out' if out else 'output'}: cannot write {out_dir}: "
                             f"{nearest} is read-only or not writable"))
    if detach:
        from draftgen.running.detach import LOG, start_detached

        args = [str(job_file.resolve()), "--grace", str(grace),
                *(f for url in server or () for f in ("--server", url)),
                *(flag for on, flag in ((retry_failed, "--retry-failed"),
                                        (redo_changed, "--redo-changed"),
                                        (rerun_truncated, "--rerun-truncated")) if on),
                *(f for c in redo_config or () for f in ("--redo-config", c)),
                *(["--metrics-port", str(metrics_port)] if metrics_port is not None else [])]
        try:
            pid = start_detached(args, out_dir.resolve())
        except OSError as e:
            raise fail(path_error(f"--out: cannot start a run in {out_dir}", e)) from None
        print(f"started in the background: pid {pid}, log {out_dir / LOG}\n"
              f"  draftgen status {out_dir}    draftgen stop {out_dir}")
        return
    # Outside the dispatch phase (which stops gracefully), SIGTERM interrupts like Ctrl+C so
    # that a server launched for the run is stopped with it.
    signal.signal(signal.SIGTERM, _interrupt)
    if os.environ.get("DRAFTGEN_DETACHED"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the terminal that started it
    opts = RunOptions(out_dir=out_dir, servers=tuple(server or ()), retry_failed=retry_failed,
                      redo_changed=redo_changed, rerun_truncated=rerun_truncated,
                      redo_configs=tuple(redo_config or ()),
                      progress=progress, grace_s=grace, metrics_port=metrics_port)
    try:
        summary = asyncio.run(run_job(job, opts))
    except DraftgenError as e:
        raise fail(e) from None
    print(summary.line(), flush=True)
    if summary.exit_code:
        raise typer.Exit(summary.exit_code)


@app.command()
def stop(out_dir: Annotated[Path, typer.Argument(help="run directory")],
         timeout: Annotated[float, typer.Option(
             min=0, help="seconds to wait for it to stop")] = 120,
         ) -> None:
    """Stop a run (detached or not) gracefully: in-flight requests finish first."""
    from draftgen.running.detach import stop_run
    from draftgen.store.run_store import LOCK, PLAN

    _run_dir(out_dir, planned=False)
    # A run that is starting has its lock before its plan; a folder with neither is no run's.
    if not (out_dir / LOCK).exists() and not (out_dir / PLAN).exists():
        raise fail(StoreError(f"{out_dir}: not a draftgen run directory (no {PLAN})"))
    try:
        stopped = stop_run(out_dir, timeout_s=timeout)
    except DraftgenError as e:
        raise fail(e) from None
    print(f"{out_dir}: {'stopped' if stopped else 'no run is using it'}")


@app.command()
def status(out_dir: Annotated[Path, typer.Argument(help="run directory")],
           as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show what a run directory holds (while it runs or after)."""
    from draftgen.reporting.status import read_status

    try:
        st = read_status(out_dir)
    except StoreError as e:
        raise fail(e) from None
    if as_json:
        _json(st.as_json())
        return
    _out.print(st.table())
    for line in st.text_lines():
        _out.print(line, markup=False)


@app.command()
def export(
    out_dir: Annotated[Path, typer.Argument(help="run directory")],
    to: Annotated[Path, typer.Option(help="file to write")],
    format: Annotated[str, typer.Option(
        help="specforge, sharegpt, parquet or tokens (input_ids + loss_mask)")] = "specforge",
    reasoning: Annotated[str, typer.Option(
        help="inline (<think>…</think> before the answer), field (reasoning_content) or drop")
    ] = "inline",
    include_truncated: Annotated[bool, typer.Option(help="also export truncated samples")] = False,
    include_flagged: Annotated[bool, typer.Option(
        help="also export samples the output checks flagged")] = False,
    tokenizer: Annotated[str | None, typer.Option(
        help="tokenizer for --format tokens (default: the job's)")] = None,
    ids: Annotated[str, typer.Option(
        help="draftgen (category-id) or source: the source row's own id where it is unique")
    ] = "draftgen",
    order: Annotated[str, typer.Option(help="plan, or source: the source files' row order")
                     ] = "plan",
) -> None:
    """Write completed samples as training data; failed, truncated and flagged are left out."""
    from draftgen.export import ExportOptions, export_run

    try:  # export_run checks every option before it reads the run
        opts = ExportOptions(format, reasoning, include_truncated,  # type: ignore[arg-type]
                             include_flagged=include_flagged, tokenizer=tokenizer,
                             ids=ids, order=order)  # type: ignore[arg-type]
        s = export_run(out_dir, to, opts)
    except DraftgenError as e:
        raise fail(e) from None
    print(s.line())


@app.command()
def report(out_dir: Annotated[Path, typer.Argument(help="run directory")],
           max_length: Annotated[int, typer.Option(
               min=1, help="training max_length to warn about (SpecForge's default: 2048)")
           ] = 2048,
           plots: Annotated[bool, typer.Option(help="also draw PNG plots")] = False) -> None:
    """Write the dataset card (OUT/DATASET_CARD.md) and, with --plots, PNG plots."""
    from draftgen.reporting.card import write_card

    _run_dir(out_dir)
    try:
        print(write_card(out_dir, max_length=max_length))
        if plots:
            from draftgen.reporting.plots import draw_plots

            for p in draw_plots(out_dir, out_dir / "plots"):
                print(p)
    except DraftgenError as e:
        raise fail(e) from None


@app.command()
def serve(
    profile: Annotated[Path | None, typer.Argument(help="server profile YAML")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the argv only")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="stop the profile's server")] = False,
    restart: Annotated[bool, typer.Option(
        "--restart", help="stop, start, verify, show what changed")] = False,
    timeout: Annotated[float, typer.Option(min=0, help="seconds to wait for the server")
                       ] = 1800.0,
) -> None:
    """Launch a server from a profile, wait for a real generation, verify it, summarise."""
    from draftgen.servers import check_profile, load_profile
    from draftgen.servers import serve as serve_profile

    # Bad input stops here with one `error:` line; what is left for `serve` to report
    # concerns the server itself.
    if sum((dry_run, stop, restart)) > 1:
        raise fail(JobError("give at most one of --dry-run, --stop, --restart"))
    if profile is None and not stop:
        raise fail(JobError("give a server profile (YAML); see examples/profiles/"))
    if profile is not None and not (stop and profile.is_dir()):
        try:
            loaded = load_profile(profile)
            if not stop:
                check_profile(loaded)
        except DraftgenError as e:
            raise fail(e) from None
    raise typer.Exit(serve_profile(profile, dry_run, stop, restart, timeout))


@app.command()
def probe(
    reference: Annotated[str, typer.Option(help="reference server URL (e.g. bf16 KV)")],
    candidate: Annotated[str, typer.Option(help="candidate server URL (e.g. fp8 KV)")],
    prompts: Annotated[Path | None, typer.Option(help="JSONL prompts (default: demo)")] = None,
    n: Annotated[int, typer.Option("-n", min=1, help="prompts to probe")] = 200,
    max_tokens: Annotated[int, typer.Option(min=1, help="greedy tokens per prompt")] = 64,
    top_k: Annotated[int, typer.Option(min=1, help="top-k log-probabilities compared")] = 10,
    model: Annotated[str | None, typer.Option(help="served model name")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """Measure how far a candidate server drifts from a reference on the same model."""
    from draftgen.probe import probe_command
    from draftgen.probe.command import load_prompts

    _check_url(reference, "--reference")
    _check_url(candidate, "--candidate")
    if json_out is not None and json_out.is_dir():
        raise fail(JobError(f"--json: {json_out} is a directory; give the file to write"))
    if prompts is not None:
        try:
            load_prompts(prompts)
        except DraftgenError as e:
            raise fail(e) from None
    raise typer.Exit(probe_command(reference, candidate, prompts, n, max_tokens, top_k,
                                   json_out, model=model))


@engine_app.command("build-model")
def build_model(out_dir: Annotated[Path, typer.Argument()] = Path(".cache/tiny-model")) -> None:
    """Build the tiny deterministic test model (no downloads)."""
    from draftgen.engine.tinymodel import STAMP_NAME, build_tiny_model

    # The build replaces what is at OUT_DIR: only ever an earlier build, never a user's files.
    if out_dir.exists() and not out_dir.is_dir():
        raise fail(JobError(f"{out_dir}: is a file; give a directory for the model"))
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / STAMP_NAME).exists():
        raise fail(JobError(f"{out_dir}: not empty and not a model draftgen built; give a new "
                            "or empty directory"))
    try:
        print(build_tiny_model(out_dir))
    except OSError as e:
        raise fail(path_error(f"{out_dir}: cannot build the model", e)) from None


def main() -> None:
    app()

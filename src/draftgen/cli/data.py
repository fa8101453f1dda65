"""Commands on a job and its run directory: plan, run, stop, status, export, report."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from draftgen.cli.app import (
    app,
    check_run_dir,
    check_url_option,
    interrupt,
    load,
    out,
    print_json,
)
from draftgen.cli.errors import fail
from draftgen.errors import DraftgenError, HostError, JobError, StoreError, path_error
from draftgen.job import read_api_key


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
    profile: Annotated[Path | None, typer.Option(
        help="predict for a server of this profile, before it exists: KV capacity from the "
             "memory model, decode speed from its `speed:` section")] = None,
) -> None:
    """Read every source, apply caps and dedup, and show what a run would generate; with
    --server, --from-run or --profile, how long it will take and what fits a --budget."""
    from draftgen.planning.forecast import parse_duration
    from draftgen.planning.plan import build_plan

    job = load(job_file)
    # Every option is checked before the plan reads a single source row.
    what_if = (budget, priority, kv_tokens, servers, write_job)
    measured_by = (server, from_run, profile)
    if all(m is None for m in measured_by) and any(o is not None for o in what_if):
        raise fail(JobError("--budget, --priority, --kv-tokens, --servers and --write-job "
                            "need --server URL, --from-run OUT or --profile PROFILE"))
    if server is not None and profile is not None:
        raise fail(JobError("give --server (measure it) or --profile (predict it), not both"))
    loaded_profile = None
    if profile is not None:
        from draftgen.servers import load_profile

        try:
            loaded_profile = load_profile(profile)
        except DraftgenError as e:
            raise fail(e) from None
    if write_job is not None and budget is None:
        raise fail(JobError("--write-job needs --budget"))
    api_key = None
    if server is not None:
        check_url_option(server, "--server")
        try:
            api_key = read_api_key(job)
        except JobError as e:
            raise fail(e) from None
    if from_run is not None:
        check_run_dir(from_run)
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
        print_json({"rows": rows, "totals": p.totals(), "token_count": p.token_count_label,
               "rejected": [{"category": r.category, "source": r.source, "row": r.row,
                             "reason": r.reason} for r in p.rejected],
               "warnings": p.warnings})
    else:
        t = Table(title=f"plan for {job_file} (prompt tokens: {p.token_count_label})")
        cols = ["category", "partition", "prompts", "samples", "rejected", "duplicates",
                "capped", "prompt_tokens", "max_output_tokens"]
        for c in cols:
            t.add_column(c.replace("_", " "), justify="left" if c in cols[:2] else "right")
        for r in [*rows, p.totals()]:
            t.add_row(*(f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in cols),
                      style="bold" if r["category"] == "total" else None)
        out.print(t)
    for warning in p.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if all(m is None for m in measured_by):
        return
    from draftgen.planning.forecast import forecast, measure

    try:
        measured = asyncio.run(measure(job, server=server, from_run=from_run,
                                       api_key=api_key, profile=loaded_profile))
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
    gateway: Annotated[list[str] | None, typer.Option(
        help="a gateway's base URL: send to its workers (repeatable)")] = None,
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

    job = load(job_file)
    out_dir = out or job.resolve(job.output)
    for url in server or ():
        check_url_option(url, "--server")
    for url in gateway or ():
        check_url_option(url, "--gateway")
    if out_dir.exists():  # a file, or a run directory whose manifest is damaged, stops here
        check_run_dir(out_dir, planned=False)
    # A read-only place for the run directory is the machine's problem: exit 1, before a plan.
    nearest = next(d for d in (out_dir, *out_dir.absolute().parents) if d.exists())
    if nearest.is_dir() and not os.access(nearest, os.W_OK | os.X_OK):
        raise fail(HostError(f"{'--out' if out else 'output'}: cannot write {out_dir}: "
                             f"{nearest} is read-only or not writable"))
    if detach:
        from draftgen.running.detach import LOG, start_detached

        args = [str(job_file.resolve()), "--grace", str(grace),
                *(f for url in server or () for f in ("--server", url)),
                *(f for url in gateway or () for f in ("--gateway", url)),
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
    signal.signal(signal.SIGTERM, interrupt)
    if os.environ.get("DRAFTGEN_DETACHED"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the terminal that started it
    opts = RunOptions(out_dir=out_dir, servers=tuple(server or ()),
                      gateways=tuple(gateway or ()), retry_failed=retry_failed,
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

    check_run_dir(out_dir, planned=False)
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
        print_json(st.as_json())
        return
    out.print(st.table())
    for line in st.text_lines():
        out.print(line, markup=False)


@app.command()
def export(
    out_dir: Annotated[Path, typer.Argument(help="run directory")],
    to: Annotated[Path, typer.Option(help="file to write")],
    format: Annotated[str, typer.Option(
        help="specforge, sharegpt, parquet or tokens (input_ids + loss_mask)")] = "specforge",
    reasoning: Annotated[str, typer.Option(
        help="inline (before the answer, as the model's chat template writes it), field "
             "(reasoning_content) or drop")
    ] = "inline",
    include_truncated: Annotated[bool, typer.Option(help="also export truncated samples")] = False,
    include_flagged: Annotated[bool, typer.Option(
        help="also export samples the output checks flagged")] = False,
    tokenizer: Annotated[str | None, typer.Option(
        help="the model's tokenizer and chat template: ids for --format tokens, and how "
             "every format writes reasoning (default: the job's)")] = None,
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

    check_run_dir(out_dir)
    try:
        print(write_card(out_dir, max_length=max_length))
        if plots:
            from draftgen.reporting.plots import draw_plots

            for p in draw_plots(out_dir, out_dir / "plots"):
                print(p)
    except DraftgenError as e:
        raise fail(e) from None

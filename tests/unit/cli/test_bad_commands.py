"""Every verb against bad input: one `error:` line naming the file or field, exit 2 for input
the user can fix and 1 for the machine, and never a traceback.

The table runs the real CLI (`draftgen.cli.app`) in-process; a few rows run it again as a
process to prove that nothing but that one line reaches stderr. Nothing here connects to a
server: a row that gives a URL fails before anything is sent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from draftgen.cli import app
from draftgen.sample import Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.writer import OutcomeWriter

JOB = """\
model: tiny
partitions:
  short: {max_tokens: 16, concurrency: 2}
categories:
  - {name: a, source: {path: a.jsonl}, partition: short}
output: out
"""

PROFILE = """\
engine: vllm
name: bad-commands
model_path: ./model
kv_cache_dtype: bfloat16
port: 8000
"""

NOWHERE = "http://127.0.0.1:9"  # nothing listens; every row using it fails before sending
NEWLINE_KEY = {"DG_TEST_KEY": "sk-first\nsecond"}


def build_run(out: Path) -> None:
    """A real run directory: a plan of three samples, two of them done."""
    samples = [Sample(id=f"a-{i}", category="a", partition="short",
                      messages=({"role": "user", "content": f"q{i}"},), max_tokens=16,
                      fingerprint="fp", source=f"a.jsonl:{i + 1}") for i in range(3)]
    with RunStore.open(out) as store:
        store.write_plan(samples, [])
        store.write_manifest({"job": {"model": "tiny"}, "runs": []})

    async def write() -> None:
        async with OutcomeWriter(out) as w:
            for i in range(2):
                turn = Turn(f"answer {i}", None, "stop", 3, 5, 0.01, 0.1)
                await w.put(Record(f"a-{i}", "fp", "a", "short",
                                   ({"role": "user", "content": f"q{i}"},), (), (turn,),
                                   NOWHERE, 1, 1.0))

    asyncio.run(write())


# A row that fails to fail early may wait for a server that never answers: stop it soon.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    """`run` makes SIGTERM interrupt like Ctrl+C; give the test process its own back."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


@pytest.fixture()
def ws(tmp_path: Path) -> Path:
    """A workspace: a good job (job.yaml, a.jsonl), a good run (run/), a good profile."""
    (tmp_path / "a.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
        '{"messages": [{"role": "user", "content": "yo"}]}\n')
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "profile.yaml").write_text(PROFILE)
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "empty-dir").mkdir()
    build_run(tmp_path / "run")
    return tmp_path


# --- what a row may do to the workspace before the command runs ---------------------------

def job(text: str) -> Callable[[Path], None]:
    return lambda ws: (ws / "job.yaml").write_text(text)


def job_edit(old: str, new: str) -> Callable[[Path], None]:
    assert old in JOB or old == "", old
    return lambda ws: (ws / "job.yaml").write_text(JOB.replace(old, new) if old else JOB + new)


def job_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda ws: (ws / "job.yaml").write_bytes(data)


def profile_edit(old: str, new: str) -> Callable[[Path], None]:
    assert old in PROFILE or old == "", old
    return lambda ws: (ws / "profile.yaml").write_text(
        PROFILE.replace(old, new) if old else PROFILE + new)


def write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def go(ws: Path) -> None:
        path = ws / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return go


def replace_with_dir(name: str) -> Callable[[Path], None]:
    def go(ws: Path) -> None:
        (ws / name).unlink()
        (ws / name).mkdir()
    return go


def torn(name: str) -> Callable[[Path], None]:
    """The file cut mid-way through its last line, as a kill or a bad copy leaves it."""
    def go(ws: Path) -> None:
        data = (ws / name).read_bytes()
        (ws / name).write_bytes(data[: len(data) - 7])
    return go


def corrupt_parquet(ws: Path) -> None:
    """A real Parquet file whose data pages are overwritten: it opens, then fails to read."""
    pq.write_table(pa.table({"prompt": [f"question {i} " * 5 for i in range(200)]}),
                   ws / "b.parquet", compression="snappy")
    data = bytearray((ws / "b.parquet").read_bytes())
    data[50:90] = b"\xab" * 40
    (ws / "b.parquet").write_bytes(bytes(data))
    (ws / "job.yaml").write_text(JOB.replace("a.jsonl}", "b.parquet, layout: prompt}"))


def both(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    def go(ws: Path) -> None:
        for step in steps:
            step(ws)
    return go


@dataclass(frozen=True)
class Bad:
    id: str
    argv: list[str]  # `{ws}` stands for the workspace
    code: int
    names: list[str]  # each must be in the error line (`{ws}` expanded)
    setup: Callable[[Path], None] | None = None
    env: dict[str, str] = field(default_factory=dict)


J = "{ws}/job.yaml"
R = "{ws}/run"
P = "{ws}/profile.yaml"
GW = "{ws}/gw.yaml"

ROWS = [
    # --- plan: the job file itself ---
    Bad("plan-missing-file", ["plan", "{ws}/nope.yaml"], 2, ["{ws}/nope.yaml", "cannot read"]),
    Bad("plan-dir-not-file", ["plan", "{ws}/empty-dir"], 2, ["{ws}/empty-dir"]),
    Bad("plan-empty-file", ["plan", J], 2, [J, "mapping", "empty"], job("")),
    Bad("plan-not-utf8", ["plan", J], 2, [J, "UTF-8"], job_bytes(b"model: \xff\xfe tiny\n")),
    Bad("plan-invalid-yaml", ["plan", J], 2, [J, "not valid YAML", "line 2"],
        job("model: [tiny\npartitions: {}\n")),
    Bad("plan-yaml-list", ["plan", J], 2, [J, "mapping", "list"], job("- model\n- tiny\n")),
    Bad("plan-yaml-scalar", ["plan", J], 2, [J, "mapping"], job("tiny\n")),
    Bad("plan-yaml-two-documents", ["plan", J], 2, [J, "not valid YAML", "single document"],
        job(JOB + "---\nmodel: other\n")),
    Bad("plan-yaml-python-tag", ["plan", J], 2, [J, "not valid YAML", "line 1"],
        job("model: !!python/object:os.system x\n")),
    Bad("plan-unknown-field", ["plan", J], 2, [J, "modle", "unknown field"],
        job_edit("model: tiny", "modle: tiny")),
    Bad("plan-wrong-type", ["plan", J], 2, [J, "categories.0.cap"],
        job_edit("partition: short}", "partition: short, cap: lots}")),
    Bad("plan-duplicate-key", ["plan", J], 2, [J, "duplicate key 'model'", "line 7", "line 1"],
        job_edit("", "model: other\n")),
    Bad("plan-duplicate-nested-key", ["plan", J], 2, [J, "duplicate key 'max_tokens'"],
        job_edit("max_tokens: 16,", "max_tokens: 16, max_tokens: 32,")),
    Bad("plan-negative-max-tokens", ["plan", J], 2, [J, "partitions.short.max_tokens"],
        job_edit("max_tokens: 16", "max_tokens: -16")),
    Bad("plan-zero-concurrency", ["plan", J], 2, [J, "partitions.short.concurrency"],
        job_edit("concurrency: 2", "concurrency: 0")),
    Bad("plan-two-bad-fields-one-line", ["plan", J], 2,
        [J, "partitions.short.max_tokens", "partitions.short.concurrency"],
        job_edit("max_tokens: 16, concurrency: 2", "max_tokens: 0, concurrency: -1")),
    Bad("plan-negative-samples", ["plan", J], 2, [J, "samples_per_prompt"],
        job_edit("", "samples_per_prompt: 0\n")),
    Bad("plan-bad-enum-scheduler", ["plan", J], 2, [J, "scheduler"],
        job_edit("", "scheduler: fastest\n")),
    Bad("plan-bad-enum-layout", ["plan", J], 2, [J, "categories.0.source.layout"],
        job_edit("a.jsonl}", "a.jsonl, layout: chatml}")),
    Bad("plan-no-categories", ["plan", J], 2, [J, "categories"],
        job("model: tiny\npartitions: {short: {max_tokens: 16}}\n")),
    Bad("plan-empty-partitions", ["plan", J], 2, [J, "partitions"],
        job_edit("  short: {max_tokens: 16, concurrency: 2}\n", "  {}\n")),
    Bad("plan-unknown-partition", ["plan", J], 2, [J, "categories.0.partition", "'long'"],
        job_edit("partition: short", "partition: long")),
    Bad("plan-duplicate-category", ["plan", J], 2, [J, "duplicate category names"],
        job_edit("output: out", "  - {name: a, source: {path: a.jsonl}}\noutput: out")),
    Bad("plan-url-without-scheme", ["plan", J], 2, [J, "servers.0.url", "http://"],
        job_edit("", "servers: [localhost:8000]\n")),
    Bad("plan-url-bad-port", ["plan", J], 2, [J, "servers.0.url", "port"],
        job_edit("", "servers: ['http://127.0.0.1:99999']\n")),
    Bad("plan-url-no-host", ["plan", J], 2, [J, "servers.0.url", "no host"],
        job_edit("", "servers: ['http://']\n")),
    Bad("plan-key-env-and-file", ["plan", J], 2, [J, "api_key_env or api_key_file"],
        job_edit("", "api_key_env: K\napi_key_file: k.txt\n")),
    # --- plan: what the job points at ---
    Bad("plan-source-missing", ["plan", J], 2, ["nope.jsonl", "no such file"],
        job_edit("a.jsonl", "nope.jsonl")),
    Bad("plan-source-is-dir", ["plan", J], 2, ["empty-dir.jsonl", "directory"],
        both(job_edit("a.jsonl", "empty-dir.jsonl"), lambda ws: (ws / "empty-dir.jsonl").mkdir())),
    Bad("plan-source-unknown-extension", ["plan", J], 2, ["a.csv", "source.format"],
        both(job_edit("a.jsonl", "a.csv"), write("a.csv", "x\n"))),
    Bad("plan-source-corrupt-parquet", ["plan", J], 2, ["b.parquet", "cannot read Parquet"],
        corrupt_parquet),
    Bad("plan-tokenizer-missing", ["plan", J], 2, ["tokenizer", "nope/tokenizer.json"],
        job_edit("", "tokenizer: nope/tokenizer.json\n")),
    Bad("plan-tokenizer-corrupt", ["plan", J], 2, ["tokenizer", "tok.json"],
        both(job_edit("", "tokenizer: tok.json\n"), write("tok.json", "{not json"))),
    # --- plan: options ---
    Bad("plan-no-argument", ["plan"], 2, ["job_file"]),
    Bad("plan-unknown-option", ["plan", J, "--bogus"], 2, ["--bogus"]),
    Bad("plan-budget-without-server", ["plan", J, "--budget", "48h"], 2, ["--budget"]),
    Bad("plan-budget-not-a-duration", ["plan", J, "--from-run", R, "--budget", "soon"], 2,
        ["--budget", "'soon'"]),
    Bad("plan-budget-negative", ["plan", J, "--from-run", R, "--budget=-5h"], 2, ["--budget"]),
    Bad("plan-budget-zero", ["plan", J, "--from-run", R, "--budget", "0h"], 2,
        ["--budget", "'0h'"]),
    Bad("plan-priority-unknown", ["plan", J, "--from-run", R, "--budget", "2h",
                                  "--priority", "a,zz"], 2, ["--priority", "'zz'"]),
    Bad("plan-write-job-without-budget", ["plan", J, "--from-run", R, "--write-job",
                                          "{ws}/capped.yaml"], 2, ["--write-job", "--budget"]),
    Bad("plan-kv-tokens-zero", ["plan", J, "--from-run", R, "--kv-tokens", "0"], 2,
        ["--kv-tokens"]),
    Bad("plan-servers-negative", ["plan", J, "--from-run", R, "--servers", "-1"], 2,
        ["--servers"]),
    Bad("plan-kv-tokens-not-int", ["plan", J, "--from-run", R, "--kv-tokens", "lots"], 2,
        ["--kv-tokens", "integer", "draftgen plan --help"]),
    Bad("plan-server-without-scheme", ["plan", J, "--server", "localhost:8000"], 2,
        ["--server", "localhost:8000", "http://"]),
    Bad("plan-server-malformed", ["plan", J, "--server", "http://exa mple:80"], 2,
        ["--server", "whitespace"]),
    Bad("plan-from-run-is-file", ["plan", J, "--from-run", "{ws}/a-file"], 2,
        ["{ws}/a-file", "not a directory"]),
    Bad("plan-from-run-not-a-run-dir", ["plan", J, "--from-run", "{ws}/empty-dir"], 2,
        ["{ws}/empty-dir", "not a draftgen run directory"]),
    Bad("plan-from-run-torn-manifest", ["plan", J, "--from-run", R], 2,
        ["{ws}/run/manifest.json"], torn("run/manifest.json")),
    Bad("plan-api-key-with-newline", ["plan", J, "--server", NOWHERE], 2,
        ["api_key_env", "DG_TEST_KEY", "line break"],
        job_edit("", "api_key_env: DG_TEST_KEY\n"), NEWLINE_KEY),
    Bad("plan-api-key-env-unset", ["plan", J, "--server", NOWHERE], 2,
        ["api_key_env", "DG_TEST_UNSET"], job_edit("", "api_key_env: DG_TEST_UNSET\n")),
    Bad("plan-api-key-file-with-newline", ["plan", J, "--server", NOWHERE], 2,
        ["api_key_file", "key.txt", "line break"],
        both(job_edit("", "api_key_file: key.txt\n"), write("key.txt", "sk-a\nsk-b\n"))),
    # --- run ---
    Bad("run-missing-job", ["run", "{ws}/nope.yaml"], 2, ["{ws}/nope.yaml"]),
    Bad("run-duplicate-key", ["run", J, "--server", NOWHERE], 2, [J, "duplicate key"],
        job_edit("", "seed: 1\nseed: 2\n")),
    Bad("run-server-without-scheme", ["run", J, "--server", "localhost:8000"], 2,
        ["--server", "localhost:8000"]),
    Bad("run-server-bad-port", ["run", J, "--server", "http://127.0.0.1:99999"], 2,
        ["--server", "port"]),
    Bad("run-out-is-file", ["run", J, "--server", NOWHERE, "--out", "{ws}/a-file"], 2,
        ["{ws}/a-file", "not a directory"]),
    Bad("run-out-torn-manifest", ["run", J, "--server", NOWHERE, "--out", R], 2,
        ["{ws}/run/manifest.json", "torn"], torn("run/manifest.json")),
    Bad("run-grace-negative", ["run", J, "--grace", "-1"], 2, ["--grace"]),
    Bad("run-metrics-port-too-big", ["run", J, "--metrics-port", "70000"], 2,
        ["--metrics-port"]),
    Bad("run-redo-config-unknown", ["run", J, "--server", NOWHERE, "--out", R,
                                    "--redo-config", "nope"], 2, ["--redo-config", "nope"]),
    Bad("run-api-key-with-newline", ["run", J, "--server", NOWHERE], 2,
        ["api_key_env", "line break"], job_edit("", "api_key_env: DG_TEST_KEY\n"),
        NEWLINE_KEY),
    Bad("run-no-server", ["run", J], 2, ["servers", "--server"]),
    # --- stop ---
    Bad("stop-missing-dir", ["stop", "{ws}/nope"], 2, ["{ws}/nope", "no such"]),
    Bad("stop-file-not-dir", ["stop", "{ws}/a-file"], 2, ["{ws}/a-file", "not a directory"]),
    Bad("stop-not-a-run-dir", ["stop", "{ws}/empty-dir"], 2, ["{ws}/empty-dir", "plan.jsonl"]),
    Bad("stop-negative-timeout", ["stop", R, "--timeout", "-1"], 2, ["--timeout"]),
    # --- status ---
    Bad("status-missing-dir", ["status", "{ws}/nope"], 2, ["{ws}/nope"]),
    Bad("status-file-not-dir", ["status", "{ws}/a-file"], 2, ["{ws}/a-file", "not a directory"]),
    Bad("status-not-a-run-dir", ["status", "{ws}/empty-dir"], 2,
        ["{ws}/empty-dir", "not a draftgen run directory"]),
    Bad("status-torn-plan", ["status", R], 2, ["{ws}/run/plan.jsonl", "line 3"],
        torn("run/plan.jsonl")),
    Bad("status-garbage-plan", ["status", R], 2, ["{ws}/run/plan.jsonl", "line 1"],
        write("run/plan.jsonl", "[1, 2, 3]\n")),
    Bad("status-binary-plan", ["status", R], 2, ["{ws}/run/plan.jsonl", "line 1"],
        write("run/plan.jsonl", b"\x00\xff\xfe garbage\n")),
    Bad("status-torn-manifest", ["status", R], 2, ["{ws}/run/manifest.json", "torn"],
        torn("run/manifest.json")),
    Bad("status-manifest-not-object", ["status", R], 2, ["{ws}/run/manifest.json"],
        write("run/manifest.json", "[]")),
    Bad("status-ledger-is-dir", ["status", R], 2, ["{ws}/run/ledger.jsonl"],
        replace_with_dir("run/ledger.jsonl")),
    Bad("status-rejected-is-dir", ["status", R], 2, ["{ws}/run/rejected.jsonl"],
        replace_with_dir("run/rejected.jsonl")),
    # --- export ---
    Bad("export-no-to", ["export", R], 2, ["--to"]),
    Bad("export-to-existing-dir", ["export", R, "--to", "{ws}/empty-dir"], 2,
        ["--to", "{ws}/empty-dir", "directory"]),
    Bad("export-to-dot", ["export", R, "--to", "."], 2, ["--to", "directory"]),
    Bad("export-to-under-a-file", ["export", R, "--to", "{ws}/a-file/x.jsonl"], 2,
        ["--to", "{ws}/a-file", "not a directory"]),
    Bad("export-to-proc", ["export", R, "--to", "/proc/draftgen-test/x.jsonl"], 1,
        ["--to", "/proc/draftgen-test/x.jsonl"]),
    Bad("export-to-sys", ["export", R, "--to", "/sys/draftgen-test.jsonl"], 1,
        ["--to", "/sys/draftgen-test.jsonl"]),
    Bad("export-over-the-plan", ["export", R, "--to", "{ws}/run/plan.jsonl"], 2,
        ["--to", "{ws}/run/plan.jsonl", "run's own files"]),
    Bad("export-into-the-shards", ["export", R, "--to", "{ws}/run/shards/00001.jsonl"], 2,
        ["--to", "run's own files"]),
    Bad("export-unknown-format", ["export", R, "--to", "{ws}/x.jsonl", "--format", "csv"], 2,
        ["--format", "'csv'", "specforge"]),
    Bad("export-bad-reasoning", ["export", R, "--to", "{ws}/x.jsonl", "--reasoning", "hide"], 2,
        ["--reasoning", "'hide'"]),
    Bad("export-bad-ids", ["export", R, "--to", "{ws}/x.jsonl", "--ids", "uuid"], 2,
        ["--ids", "'uuid'"]),
    Bad("export-bad-order", ["export", R, "--to", "{ws}/x.jsonl", "--order", "random"], 2,
        ["--order", "'random'"]),
    Bad("export-run-is-file", ["export", "{ws}/a-file", "--to", "{ws}/x.jsonl"], 2,
        ["{ws}/a-file", "not a directory"]),
    Bad("export-not-a-run-dir", ["export", "{ws}/empty-dir", "--to", "{ws}/x.jsonl"], 2,
        ["{ws}/empty-dir", "not a draftgen run directory"]),
    Bad("export-torn-plan", ["export", R, "--to", "{ws}/x.jsonl"], 2,
        ["{ws}/run/plan.jsonl"], torn("run/plan.jsonl")),
    Bad("export-damaged-shard", ["export", R, "--to", "{ws}/x.jsonl"], 2,
        ["{ws}/run/shards/00001.jsonl", "damaged"], torn("run/shards/00001.jsonl")),
    Bad("export-missing-shard", ["export", R, "--to", "{ws}/x.jsonl"], 2,
        ["{ws}/run/shards/00001.jsonl"], lambda ws: (ws / "run/shards/00001.jsonl").unlink()),
    # --- report ---
    Bad("report-not-a-run-dir", ["report", "{ws}/empty-dir"], 2, ["{ws}/empty-dir"]),
    Bad("report-file-not-dir", ["report", "{ws}/a-file"], 2, ["{ws}/a-file"]),
    Bad("report-torn-manifest", ["report", R], 2, ["{ws}/run/manifest.json"],
        torn("run/manifest.json")),
    Bad("report-torn-plan", ["report", R], 2, ["{ws}/run/plan.jsonl"], torn("run/plan.jsonl")),
    Bad("report-max-length-zero", ["report", R, "--max-length", "0"], 2, ["--max-length"]),
    # --- serve ---
    Bad("serve-missing-profile", ["serve", "{ws}/nope.yaml"], 2, ["{ws}/nope.yaml"]),
    Bad("serve-profile-is-dir", ["serve", "{ws}/empty-dir"], 2, ["{ws}/empty-dir"]),
    Bad("serve-no-profile", ["serve"], 2, ["profile"]),
    Bad("serve-two-modes", ["serve", P, "--dry-run", "--stop"], 2, ["--dry-run", "--stop"]),
    Bad("serve-negative-timeout", ["serve", P, "--timeout", "-5"], 2, ["--timeout"]),
    Bad("serve-invalid-yaml", ["serve", P], 2, [P, "not valid YAML"],
        write("profile.yaml", "engine: [vllm\n")),
    Bad("serve-not-utf8", ["serve", P], 2, [P, "UTF-8"], write("profile.yaml", b"\xff\n")),
    Bad("serve-unknown-field", ["serve", P, "--dry-run"], 2, [P, "engien", "unknown field"],
        profile_edit("engine:", "engien:")),
    Bad("serve-bad-engine", ["serve", P, "--dry-run"], 2, [P, "engine"],
        profile_edit("engine: vllm", "engine: tgi")),
    Bad("serve-negative-tp", ["serve", P, "--dry-run"], 2, [P, "tp"], profile_edit("", "tp: 0\n")),
    Bad("serve-duplicate-key", ["serve", P, "--dry-run"], 2, [P, "duplicate key 'port'"],
        profile_edit("", "port: 8001\n")),
    Bad("serve-lossy-kv", ["serve", P, "--dry-run"], 2, ["kv_cache_dtype", "fp8"],
        profile_edit("kv_cache_dtype: bfloat16", "kv_cache_dtype: fp8_e4m3")),
    Bad("serve-stop-bad-profile", ["serve", P, "--stop"], 2, [P, "engine"],
        profile_edit("engine: vllm", "engine: tgi")),
    # --- serve: a gateway profile (workers and a gateway) ---
    Bad("serve-gateway-unknown-field", ["serve", GW, "--dry-run"], 2,
        [GW, "gateway.prot", "unknown field"],
        write("gw.yaml", "gateway: {workers: [profile.yaml], prot: 1}\n")),
    Bad("serve-gateway-no-workers", ["serve", GW], 2, [GW, "gateway.workers"],
        write("gw.yaml", "gateway: {workers: []}\n")),
    Bad("serve-gateway-missing-worker", ["serve", GW, "--dry-run"], 2,
        [GW, "gateway.workers.1", "{ws}/nope.yaml", "cannot read"],
        write("gw.yaml", "gateway: {workers: [profile.yaml, nope.yaml]}\n")),
    Bad("serve-gateway-bad-worker", ["serve", GW], 2, [GW, "gateway.workers.0", P, "tp"],
        both(profile_edit("", "tp: 0\n"),
             write("gw.yaml", "gateway: {workers: [profile.yaml]}\n"))),
    Bad("serve-gateway-lossy-worker", ["serve", GW, "--dry-run"], 2,
        [P, "kv_cache_dtype", "fp8"],
        both(profile_edit("kv_cache_dtype: bfloat16", "kv_cache_dtype: fp8_e4m3"),
             write("gw.yaml", "gateway: {workers: [profile.yaml]}\n"))),
    Bad("serve-gateway-port-twice", ["serve", GW, "--dry-run"], 2,
        [GW, "gateway.workers", "port 8000"],
        both(write("p2.yaml", PROFILE.replace("bad-commands", "other")),
             write("gw.yaml", "gateway: {workers: [profile.yaml, p2.yaml]}\n"))),
    Bad("serve-gateway-stop-bad", ["serve", GW, "--stop"], 2, [GW, "gateway.prot"],
        write("gw.yaml", "gateway: {workers: [profile.yaml], prot: 1}\n")),
    Bad("run-launch-gateway-missing-worker", ["run", J], 2, [GW, "gateway.workers.0"],
        both(job_edit("", "servers: [{launch: gw.yaml}]\n"),
             write("gw.yaml", "gateway: {workers: [nope.yaml]}\n"))),
    # --- tune ---
    Bad("tune-no-job", ["tune", P], 2, ["--job"]),
    Bad("tune-missing-profile", ["tune", "{ws}/nope.yaml", "--job", J], 2, ["{ws}/nope.yaml"]),
    Bad("tune-missing-job", ["tune", P, "--job", "{ws}/nope.yaml"], 2, ["{ws}/nope.yaml"]),
    Bad("tune-bad-budget", ["tune", P, "--job", J, "--budget", "soon"], 2,
        ["--budget", "soon"]),
    Bad("tune-zero-budget", ["tune", P, "--job", J, "--budget", "0m"], 2, ["--budget"]),
    Bad("tune-write-is-dir", ["tune", P, "--job", J, "--write", "{ws}/empty-dir"], 2,
        ["--write", "{ws}/empty-dir"]),
    Bad("tune-lengths-from-not-a-run", ["tune", P, "--job", J, "--lengths-from",
                                        "{ws}/empty-dir"], 2, ["{ws}/empty-dir"]),
    Bad("tune-profile-unknown-field", ["tune", P, "--job", J], 2, [P, "engien"],
        profile_edit("", "engien: vllm\n")),
    # --- probe ---
    Bad("probe-no-reference", ["probe", "--candidate", NOWHERE], 2, ["--reference"]),
    Bad("probe-reference-without-scheme", ["probe", "--reference", "localhost:8000",
                                           "--candidate", NOWHERE], 2, ["--reference"]),
    Bad("probe-candidate-no-host", ["probe", "--reference", NOWHERE, "--candidate", "http://"],
        2, ["--candidate", "'http://'"]),
    Bad("probe-n-zero", ["probe", "--reference", NOWHERE, "--candidate", NOWHERE, "-n", "0"],
        2, ["-n"]),
    Bad("probe-n-not-int", ["probe", "--reference", NOWHERE, "--candidate", NOWHERE, "-n",
                            "many"], 2, ["-n", "integer", "draftgen probe --help"]),
    Bad("probe-top-k-negative", ["probe", "--reference", NOWHERE, "--candidate", NOWHERE,
                                 "--top-k", "-3"], 2, ["--top-k"]),
    Bad("probe-prompts-missing", ["probe", "--reference", NOWHERE, "--candidate", NOWHERE,
                                  "--prompts", "{ws}/nope.jsonl"], 2, ["{ws}/nope.jsonl"]),
    Bad("probe-prompts-is-dir", ["probe", "--reference", NOWHERE, "--candidate", NOWHERE,
                                 "--prompts", "{ws}/empty-dir"], 2, ["{ws}/empty-dir"]),
    Bad("probe-prompts-no-usable-row", ["probe", "--reference", NOWHERE, "--candidate",
                                        NOWHERE, "--prompts", "{ws}/junk.jsonl"], 2,
        ["{ws}/junk.jsonl"], write("junk.jsonl", "not json\n[1]\n")),
    Bad("probe-json-is-dir", ["probe", "--reference", NOWHERE, "--candidate", NOWHERE,
                              "--json", "{ws}/empty-dir"], 2, ["--json", "{ws}/empty-dir"]),
    # --- engine build-model ---
    Bad("build-model-on-a-file", ["engine", "build-model", "{ws}/a-file"], 2, ["{ws}/a-file"]),
    Bad("build-model-over-user-files", ["engine", "build-model", "{ws}/run"], 2,
        ["{ws}/run", "not empty"]),
    Bad("build-model-under-sys", ["engine", "build-model", "/sys/draftgen-test/model"], 1,
        ["/sys/draftgen-test/model"]),
    # --- the command itself ---
    Bad("unknown-command", ["bogus"], 2, ["bogus"]),
    Bad("engine-unknown-command", ["engine", "bogus"], 2, ["bogus"]),
]


def _expand(text: str, ws: Path) -> str:
    return text.replace("{ws}", str(ws))


def _check_one_error_line(stdout: str, stderr: str, code: int, expected: Bad, ws: Path,
                          exit_code: int) -> None:
    assert "Traceback" not in stdout + stderr
    assert exit_code == code, (exit_code, stdout, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert stdout == "", stdout
    (line,) = lines
    assert line.startswith("error: "), line
    for name in expected.names:
        assert _expand(name, ws) in line, (name, line)


@pytest.mark.parametrize("bad", ROWS, ids=[r.id for r in ROWS])
def test_bad_command_fails_in_one_line(bad: Bad, ws: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if bad.setup is not None:
        bad.setup(ws)
    monkeypatch.chdir(ws)
    for key in ("DG_TEST_KEY", "DG_TEST_UNSET"):
        monkeypatch.delenv(key, raising=False)
    # Serve and probe write state under the servers dir: keep it in the workspace.
    monkeypatch.setenv("DRAFTGEN_SERVERS_DIR", str(ws / "servers"))
    result = CliRunner().invoke(app, [_expand(a, ws) for a in bad.argv], env=bad.env)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    _check_one_error_line(result.stdout, result.stderr, bad.code, bad, ws, result.exit_code)


def test_row_ids_are_unique_and_every_verb_has_rows() -> None:
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))
    # Every verb `draftgen --help` lists, sub-commands included: a new one needs rows here.
    verbs = set()
    for name, command in typer.main.get_command(app).commands.items():
        subs = getattr(command, "commands", None)
        verbs |= {f"{name} {sub}" for sub in subs} if subs else {name}
    assert {"plan", "run", "stop", "status", "export", "report", "serve", "probe",
            "engine build-model"} <= verbs
    tested = {" ".join(r.argv[:2]) if r.argv[0] == "engine" else r.argv[0] for r in ROWS}
    assert verbs <= tested, sorted(verbs - tested)


# Rows run again as a real process: nothing but the one line may reach stderr.
PROCESS_ROWS = ["plan-not-utf8", "plan-duplicate-key", "plan-source-corrupt-parquet",
                "status-torn-plan", "status-file-not-dir", "export-to-existing-dir",
                "export-to-proc", "plan-api-key-with-newline", "probe-n-not-int"]


@pytest.mark.parametrize("row_id", PROCESS_ROWS)
def test_bad_command_as_a_process_prints_one_line(row_id: str, ws: Path) -> None:
    bad = next(r for r in ROWS if r.id == row_id)
    if bad.setup is not None:
        bad.setup(ws)
    env = {k: v for k, v in os.environ.items() if k not in ("DG_TEST_KEY", "DG_TEST_UNSET")}
    env |= {**bad.env, "DRAFTGEN_SERVERS_DIR": str(ws / "servers"), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "draftgen", *(_expand(a, ws) for a in bad.argv)],
                          cwd=ws, env=env, capture_output=True, text=True, timeout=120)
    _check_one_error_line(proc.stdout, proc.stderr, bad.code, bad, ws, proc.returncode)


@pytest.fixture()
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing may be written in: a read-only tmpfs for root (whom permissions
    do not stop), else one without write permission."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


READ_ONLY_ROWS = [
    Bad("export-to-read-only-dir", ["export", R, "--to", "{ro}/x.jsonl"], 1,
        ["--to", "{ro}/x.jsonl"]),
    Bad("export-to-missing-parent-in-read-only-dir", ["export", R, "--to",
                                                       "{ro}/new/x.jsonl"], 1,
        ["--to", "{ro}/new/x.jsonl"]),
    Bad("run-out-in-read-only-dir", ["run", J, "--server", NOWHERE, "--out", "{ro}/out"], 1,
        ["--out", "{ro}/out", "{ro}"]),
    Bad("build-model-in-read-only-dir", ["engine", "build-model", "{ro}/model"], 1,
        ["{ro}/model"]),
]


@pytest.mark.parametrize("bad", READ_ONLY_ROWS, ids=[r.id for r in READ_ONLY_ROWS])
def test_an_unwritable_destination_is_the_machines_problem(bad: Bad, ws: Path,
                                                           read_only: Path) -> None:
    argv = [_expand(a, ws).replace("{ro}", str(read_only)) for a in bad.argv]
    result = CliRunner().invoke(app, argv)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    named = Bad(bad.id, bad.argv, bad.code, [n.replace("{ro}", str(read_only))
                                             for n in bad.names])
    _check_one_error_line(result.stdout, result.stderr, bad.code, named, ws, result.exit_code)
    assert list(read_only.iterdir()) == []  # and nothing was left there


def test_a_torn_ledger_is_not_an_error_status_reads_around_it(ws: Path) -> None:
    # A kill mid-append leaves a torn ledger line: the design's normal case, not bad input.
    torn("run/ledger.jsonl")(ws)
    result = CliRunner().invoke(app, ["status", str(ws / "run"), "--json"])
    assert result.exit_code == 0, result.output
    assert '"done": 1' in result.stdout and '"pending": 2' in result.stdout


def test_status_names_what_it_counts_as_rejected(ws: Path) -> None:
    (ws / "run" / "rejected.jsonl").write_text(
        '{"reason": "a"}\n{"reason": "b"}\n{"reason": "prompt_too_long: 6,000 tokens"}\n')
    result = CliRunner().invoke(app, ["status", str(ws / "run")])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if x.startswith("set aside"))
    assert "rejected.jsonl" in line
    assert "2 source rows, 1 prompts too long for the server's context" in line


def test_an_os_error_no_command_expected_is_one_line_and_exit_1(
        ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The last resort: an OSError that no command turned into its own error.
    def refuse(out_dir: Path) -> None:
        raise PermissionError(13, "Permission denied", str(out_dir / "ledger.jsonl"))

    monkeypatch.setattr("draftgen.reporting.status.read_status", refuse)
    result = CliRunner().invoke(app, ["status", str(ws / "run")])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"error: {ws / 'run' / 'ledger.jsonl'}: Permission denied\n"


def test_no_arguments_still_shows_the_help() -> None:
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 2
    assert "Usage" in result.output and "error:" not in result.output


def test_rejection_reasons_read_as_english(ws: Path) -> None:
    (ws / "a.jsonl").write_text('{"messages": {"role": "user"}}\n{"messages": [["hi"]]}\n'
                                '{"messages": [{"role": "user", "content": "ok"}]}\n')
    result = CliRunner().invoke(app, ["plan", str(ws / "job.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    reasons = [r["reason"] for r in orjson.loads(result.stdout)["rejected"]]
    assert reasons == ["wrong_type: 'messages' is an object, expected an array",
                       "wrong_type: messages[0] is an array, expected an object"]

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from draftgen.cli import app
from draftgen.errors import JobError
from draftgen.job import load_job

GOOD = """
model: tiny
servers: [http://127.0.0.1:8000/]
sampling:
  temperature: 0.6
  top_p: 0.95
  seed: 7
  extra_body: {chat_template_kwargs: {thinking: false}}
partitions:
  short: {max_tokens: 10240, concurrency: 150}
  long: {max_tokens: 16384, concurrency: 32, min_prompt_tokens: 4096}
categories:
  - {name: B1, source: {path: b1.jsonl}, cap: 10, partition: short}
  - {name: B2, source: {path: b2.parquet, layout: conversations}, system_prompt: Be brief.}
  - {name: B3, source: {hf_dataset: org/set, hf_split: test, layout: prompt, field: question}}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_a_full_job_loads_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, GOOD))
    assert job.servers[0].url == "http://127.0.0.1:8000"
    assert job.partitions["long"].min_prompt_tokens == 4096
    assert job.categories[1].partition == "auto"
    assert job.categories[2].source.field_name == "question"
    assert job.resolve("b1.jsonl") == tmp_path / "b1.jsonl"
    assert job.sampling.extra_body == {"chat_template_kwargs": {"thinking": False}}


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        (("temperature: 0.6", "temprature: 0.6"), "sampling.temprature", "unknown field"),
        (("max_tokens: 10240", "max_tokens: -1"), "partitions.short.max_tokens", "greater than 0"),
        (("partition: short", "partition: medium"), "categories.0.partition", "'medium'"),
        (("{path: b1.jsonl}", "{}"), "categories.0.source", "exactly one of"),
        (("http://127.0.0.1:8000/", "localhost:8000"), "servers.0.url", "http://"),
    ],
)
def test_errors_name_the_file_and_the_field(
    tmp_path: Path, change: tuple[str, str], field: str, message: str
) -> None:
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(JobError) as info:
        load_job(path)
    text = str(info.value)
    assert str(path) in text
    assert field in text
    assert message in text


def test_cli_exits_2_with_one_clear_message(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("cap: 10", "cap: lots"))
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert "categories.0.cap" in result.output
    assert "Traceback" not in result.output


def test_missing_and_non_mapping_files_are_job_errors(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="cannot read"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobError, match="mapping"):
        load_job(write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(write(tmp_path, "model: [unclosed\n"))

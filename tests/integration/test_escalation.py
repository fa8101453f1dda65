"""Truncated answers re-run with a larger max_tokens, end to end on the real engine."""

from __future__ import annotations

from pathlib import Path

import orjson
from test_pipeline import draftgen, shard_records

from draftgen.local import LocalEngine


def test_rerun_truncated_escalates_to_the_long_partition(
    local_engine: LocalEngine, tmp_path: Path
) -> None:
    rows = [{"id": i, "messages": [{"role": "user", "content": f"Say something, {i}."}]}
            for i in range(40)]
    (tmp_path / "p.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    job = tmp_path / "job.yaml"
    # The end-token bias makes answers stop after a long-tailed few dozen tokens: some are
    # cut at 24 tokens, and nearly all fit in 400.
    job.write_text(f"""
model: tiny
servers: [{local_engine.url}]
sampling: {{temperature: 0.7, seed: 3, extra_body: {{logit_bias: {{"2": 4.0}}}}}}
partitions:
  short: {{max_tokens: 24, concurrency: 8, truncation: escalate, escalate_to: long}}
  long: {{max_tokens: 400, concurrency: 4}}
categories: [{{name: c, source: {{path: p.jsonl, id_field: id}}, partition: short}}]
output: out
""")
    out = tmp_path / "out"
    first = draftgen("run", str(job))
    assert first.returncode == 0, first.stderr
    before = orjson.loads(draftgen("status", str(out), "--json").stdout)
    truncated = before["truncated"]
    assert 0 < truncated < 40
    flags = before["flags"]
    assert flags.get("truncated_in_answer", 0) + flags.get("truncated_in_reasoning", 0) \
        == truncated

    again = draftgen("run", str(job), "--rerun-truncated")
    assert again.returncode == 0, again.stderr
    assert f"sent {truncated} this run" in again.stdout
    after = orjson.loads(draftgen("status", str(out), "--json").stdout)
    assert after["done"] == 40 and after["truncated"] < truncated
    latest = {r["id"]: r for r in shard_records(out)}
    long_ones = [r for r in latest.values() if r["partition"] == "long"]
    assert len(long_ones) == truncated
    assert all(r["turns"][0]["completion_tokens"] > 24 or r["turns"][0]["finish_reason"]
               == "stop" for r in long_ones)
    settled = draftgen("run", str(job))
    assert "sent 0 this run" in settled.stdout

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import orjson
import pytest

from draftgen.errors import DiskError, JobChangedError, StoreError
from draftgen.sample import Failure, Record, Sample, Turn
from draftgen.store import RunStore
from draftgen.store.ledger import LedgerEntry, load_ledger
from draftgen.store.run_store import LEDGER
from draftgen.store.writer import OutcomeWriter


def sample(i: int, fp: str = "fp") -> Sample:
    return Sample(id=f"c-{i}", category="c", partition="short",
                  messages=({"role": "user", "content": f"q{i}"},), max_tokens=8,
                  fingerprint=fp)


def record(i: int, fp: str = "fp", finish: str = "stop") -> Record:
    turn = Turn(f"answer {i}", None, finish, 3, 5, 0.01, 0.1)
    return Record(f"c-{i}", fp, "c", "short", ({"role": "user", "content": f"q{i}"},), (),
                  (turn,), "http://x", 1, 1.0)


def write(out: Path, outcomes: list[Record | Failure], **kw: int) -> None:
    async def go() -> None:
        async with OutcomeWriter(out, **kw) as w:
            for o in outcomes:
                await w.put(o)

    asyncio.run(go())


def test_ledger_lines_keep_their_compact_keys() -> None:
    line = (b'{"id":"c-1","fp":"f","status":"done","cat":"c","part":"short",'
            b'"shard":"shards/00000.jsonl","off":0,"len":10,"otok":5,"finish":"length",'
            b'"trunc":true,"attempts":1,"t":1.5,"flags":["truncated"],"cfg":"x"}\n')
    e = LedgerEntry.from_json(orjson.loads(line))
    assert (e.fingerprint, e.category, e.partition, e.offset, e.length, e.output_tokens,
            e.truncated, e.time, e.configuration) == ("f", "c", "short", 0, 10, 5, True, 1.5, "x")
    assert e.to_line() == line  # what was read is written back byte for byte


def test_written_records_are_done_and_not_pending(tmp_path: Path) -> None:
    write(tmp_path, [record(i) for i in range(5)])
    with RunStore.open(tmp_path) as store:
        assert sorted(store.entries) == [f"c-{i}" for i in range(5)]
        todo = store.pending([sample(i) for i in range(8)])
    assert [s.id for s in todo] == ["c-5", "c-6", "c-7"]


def test_failures_are_recorded_and_only_retried_on_request(tmp_path: Path) -> None:
    fail = Failure("c-1", "fp", "c", "short", "bad_request", "400: nope", 1, "http://x", 1.0)
    write(tmp_path, [record(0), fail])
    with RunStore.open(tmp_path) as store:
        assert store.entries["c-1"].status == "failed"
        assert store.entries["c-1"].reason == "bad_request: 400: nope"
        assert [s.id for s in store.pending([sample(0), sample(1)])] == []
        assert [s.id for s in store.pending([sample(0), sample(1)], retry_failed=True)] == ["c-1"]


def test_torn_ledger_line_is_cut_and_its_record_adopted_from_the_shard(tmp_path: Path) -> None:
    write(tmp_path, [record(i) for i in range(3)])
    ledger = tmp_path / LEDGER
    data = ledger.read_bytes()
    ledger.write_bytes(data[: len(data) - 10])  # kill mid-way through the last ledger line
    with RunStore.open(tmp_path) as store:
        assert store.repair.ledger_torn_bytes > 0
        assert store.repair.adopted_records == 1
        assert sorted(store.entries) == ["c-0", "c-1", "c-2"]
    # The repair is durable and idempotent: a second open finds nothing to fix.
    with RunStore.open(tmp_path) as store:
        assert not store.repair.any
        assert len(load_ledger(tmp_path / LEDGER, repair=False).entries) == 3


def test_torn_shard_tail_is_cut_and_never_counted(tmp_path: Path) -> None:
    write(tmp_path, [record(i) for i in range(2)])
    shard = tmp_path / "shards" / "00001.jsonl"
    good = shard.read_bytes()
    torn = orjson.dumps(record(2))[:30]
    shard.write_bytes(good + torn)
    with RunStore.open(tmp_path) as store:
        assert store.repair.shard_torn_bytes == len(torn)
        assert sorted(store.entries) == ["c-0", "c-1"]
    assert shard.read_bytes() == good


def test_record_missing_from_ledger_is_adopted_once(tmp_path: Path) -> None:
    write(tmp_path, [record(0)])
    shard = tmp_path / "shards" / "00001.jsonl"
    with open(shard, "ab") as f:  # killed after the shard fsync, before the ledger line
        f.write(orjson.dumps(record(1)) + b"\n")
    with RunStore.open(tmp_path) as store:
        assert store.repair.adopted_records == 1
        assert store.entries["c-1"].status == "done"
    with RunStore.open(tmp_path) as store:
        assert store.repair.adopted_records == 0
    lines = (tmp_path / LEDGER).read_bytes().splitlines()
    assert sorted(orjson.loads(x)["id"] for x in lines) == ["c-0", "c-1"]


def test_changed_requests_are_refused_unless_asked(tmp_path: Path) -> None:
    write(tmp_path, [record(0, fp="old"), record(1, fp="new")])
    with RunStore.open(tmp_path) as store:
        with pytest.raises(JobChangedError, match="1 recorded sample"):
            store.pending([sample(0, fp="new"), sample(1, fp="new")])
        todo = store.pending([sample(0, fp="new"), sample(1, fp="new")], redo_changed=True)
    assert [s.id for s in todo] == ["c-0"]


def test_a_second_process_cannot_open_a_directory_in_use(tmp_path: Path) -> None:
    with RunStore.open(tmp_path), pytest.raises(StoreError, match="another draftgen run"):
        RunStore.open(tmp_path)


def test_shards_rotate_and_records_stay_addressable(tmp_path: Path) -> None:
    write(tmp_path, [record(i) for i in range(10)], max_batch=2, shard_max_bytes=300)
    shards = sorted((tmp_path / "shards").glob("*.jsonl"))
    assert len(shards) > 1
    with RunStore.open(tmp_path) as store:
        for i in range(10):
            e = store.entries[f"c-{i}"]
            assert e.shard is not None
            with open(tmp_path / e.shard, "rb") as f:
                f.seek(e.offset)
                assert orjson.loads(f.read(e.length))["id"] == f"c-{i}"


def test_write_error_stops_the_writer_and_keeps_committed_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftgen.store import shards

    real_append = shards.ShardWriter.append
    calls = {"n": 0}

    def flaky(self: shards.ShardWriter, lines: list[bytes]) -> list[tuple[str, int, int]]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(self, lines)

    monkeypatch.setattr(shards.ShardWriter, "append", flaky)

    async def go() -> None:
        async with OutcomeWriter(tmp_path, max_batch=1) as w:
            await w.put(record(0))
            await asyncio.sleep(0.05)
            await w.put(record(1))
            await w.failed.wait()
            await w.put(record(2))  # dropped, not raised: it stays pending

    with pytest.raises(DiskError, match="no space left on device"):
        asyncio.run(go())
    monkeypatch.setattr(shards.ShardWriter, "append", real_append)
    with RunStore.open(tmp_path) as store:
        assert sorted(store.entries) == ["c-0"]

"""The one tally of done/failed/truncated/pending, and its callers agreeing on it."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from draftgen.errors import StoreError
from draftgen.reporting.card import collect
from draftgen.reporting.status import read_status
from draftgen.store.ledger import LedgerEntry
from draftgen.store.reading import RejectedCounts, count_rejected
from draftgen.store.run_store import LEDGER, PLAN, REJECTED
from draftgen.store.tally import CategoryTally, current, tally

PLAN_ROWS = [
    {"id": "a0", "category": "a", "fingerprint": "f"},  # done, truncated
    {"id": "a1", "category": "a", "fingerprint": "f"},  # done, no shard (damaged ledger)
    {"id": "a2", "category": "a", "fingerprint": "f"},  # failed
    {"id": "b0", "category": "b", "fingerprint": "f"},  # recorded for an older request
    {"id": "b1", "category": "b", "fingerprint": "f"},  # never sent
]
ENTRIES = {
    "a0": LedgerEntry("a0", "f", "done", "a", "p", shard="shards/00000.jsonl", length=1,
                      output_tokens=7, truncated=True),
    "a1": LedgerEntry("a1", "f", "done", "a", "p", output_tokens=5),
    "a2": LedgerEntry("a2", "f", "failed", "a", "p", reason="http_500: boom"),
    "b0": LedgerEntry("b0", "old", "done", "b", "p", output_tokens=9),
    "gone": LedgerEntry("gone", "f", "done", "a", "p"),  # not in the plan: not counted
}


def test_each_planned_sample_counts_once_by_its_current_entry() -> None:
    counted = tally(current(PLAN_ROWS, ENTRIES), CategoryTally)
    assert counted.categories == {
        # A done entry without a shard is done: the ledger says so; only its record
        # cannot be read (readers of records pass over it).
        "a": CategoryTally(total=3, done=2, failed=1, truncated=1, pending=0,
                           output_tokens=12),
        # An entry of an older request is no answer to this one: pending.
        "b": CategoryTally(total=2, pending=2),
    }
    assert [(c, e.id) for c, e in counted.done] == [("a", "a0"), ("a", "a1")]
    assert [(c, e.id) for c, e in counted.failed] == [("a", "a2")]


def test_the_caller_says_which_entry_is_current() -> None:
    # As a run does: what it will send again (a2, retried) is pending, whatever its entry.
    planned = [("a", None if i == "a2" else ENTRIES.get(i)) for i in ("a0", "a1", "a2")]
    assert tally(planned, CategoryTally).categories["a"] == CategoryTally(
        total=3, done=2, pending=1, truncated=1, output_tokens=12)


def make_run(out: Path) -> None:
    out.mkdir()
    (out / PLAN).write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in PLAN_ROWS))
    ledger = [e for i, e in ENTRIES.items() if i != "a0"]  # no shard to read a0 from
    (out / LEDGER).write_bytes(b"".join(e.to_line() for e in ledger))


def test_status_and_the_card_count_alike(tmp_path: Path) -> None:
    out = tmp_path / "run"
    make_run(out)
    (out / REJECTED).write_bytes(
        b'{"row": 1}\n\n{"row": 2}\n{"row": 3, "reason": "prompt_too_long: 9,000"}\n')
    status, card = read_status(out), collect(out)
    for name in ("total", "done", "failed", "truncated", "pending", "output_tokens"):
        assert getattr(status, name) == card.total(name), name
    assert (status.done, status.failed, status.pending) == (1, 1, 3)
    # Bad source rows and prompts too long for the context, named apart.
    assert status.rejected == card.rejected == RejectedCounts(rows=2, too_long=1)
    assert card.categories["a"].lengths == [5]


def test_rejected_entries_are_counted_and_an_unreadable_file_is_a_store_error(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    make_run(out)
    assert count_rejected(out).total == 0  # none yet
    (out / REJECTED).mkdir()  # there, but not readable as a file
    for read in (count_rejected, read_status, collect):
        with pytest.raises(StoreError, match=r"rejected\.jsonl: cannot read"):
            read(out)

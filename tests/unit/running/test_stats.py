from __future__ import annotations

import asyncio
import io

from draftgen.clock import FakeClock, format_duration
from draftgen.running.progress import ProgressView, plain_line, table
from draftgen.running.stats import RunStats
from draftgen.sample import Failure, Record, Turn


def record(cat: str, tokens: int, finish: str = "stop") -> Record:
    turn = Turn("x", None, finish, 1, tokens, 0.1, 1.0)
    return Record("id", "fp", cat, "short", (), (), (turn,), "s", 1, 0.0)


def test_eta_is_what_the_dispatcher_says_and_unknown_without_one() -> None:
    stats = RunStats(FakeClock())
    stats.plan("short", planned=10)
    assert stats.snapshot().eta_s is None
    stats.eta_view = lambda: 12.5
    assert stats.snapshot().eta_s == 12.5


def test_window_rate_forgets_tokens_older_than_a_minute() -> None:
    clock = FakeClock()
    stats = RunStats(clock)
    stats.plan("c", planned=1)
    for _ in range(600):
        stats.token()
    clock.advance(120.0)
    stats.token()
    snap = stats.snapshot()
    assert snap.tok_s_window == 1 / 60
    assert snap.tok_s_overall == 601 / 120


def test_counts_done_failed_truncated_and_earlier_runs() -> None:
    stats = RunStats(FakeClock())
    stats.plan("c", planned=5)
    stats.already("c", done=2, failed=0, truncated=1, output_tokens=20)
    stats.started("c")
    stats.finished(record("c", 10, finish="length"))
    stats.started("c")
    stats.finished(Failure("id", "fp", "c", "short", "bad_request", "no", 1, "s", 0.0))
    stats.started("c")
    c = stats.snapshot().categories[0]
    assert (c.done, c.failed, c.truncated, c.in_flight, c.pending, c.output_tokens) == (
        3, 1, 2, 1, 1, 30)


def test_plain_line_and_table_show_the_numbers() -> None:
    stats = RunStats(FakeClock())
    stats.plan("code", planned=3)
    stats.note = "server down"
    line = plain_line(stats.snapshot())
    assert "done 0/3" in line and "pending 3" in line and line.endswith("server down")
    assert table(stats.snapshot()).row_count == 1
    assert format_duration(90061) == "1d01h" and format_duration(3700) == "1h01m"
    assert format_duration(None) == "?" and format_duration(5.44) == "5.4s"
    assert format_duration(65.9) == "1m05s"


async def test_plain_view_prints_a_line_per_interval() -> None:
    stats = RunStats(FakeClock())
    stats.plan("c", planned=1)
    out = io.StringIO()
    view = ProgressView(stats.snapshot, live=False, interval_s=0.01, stream=out)
    task = asyncio.create_task(view.run())
    async with asyncio.timeout(10):
        while out.getvalue().count("done 0/1") < 2:
            await asyncio.sleep(0.01)
    task.cancel()
    assert all(line.startswith("[") for line in out.getvalue().splitlines())

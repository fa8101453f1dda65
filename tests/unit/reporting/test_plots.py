"""PNG plots of a run directory."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import orjson
import pytest

from draftgen.reporting.plots import PlotError, draw_plots, read_series
from draftgen.store.ledger import LedgerEntry

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(out: Path, n: int = 300, *, series: bool = True) -> None:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    plan, ledger = [], []
    t0 = 1_767_225_600.0
    for i in range(n):
        cat = ("chat", "code", "math")[i % 3]
        max_tokens = 256 if cat != "math" else 128
        otok = min(max_tokens, int(rng.expovariate(1 / 60)) + 1)
        plan.append({"id": f"s{i}", "category": cat, "partition": "short",
                     "fingerprint": f"f{i}", "prompt_tokens": 20, "max_tokens": max_tokens})
        if i % 10 == 9:
            continue  # pending
        ledger.append(LedgerEntry(f"s{i}", f"f{i}", "done", cat, "short", output_tokens=otok,
                                  finish="length" if otok == max_tokens else "stop",
                                  truncated=otok == max_tokens, time=t0 + i * 0.5).to_line())
    ledger.append(LedgerEntry("s9", "f9", "failed", "chat", "short", reason="bad").to_line())
    (out / "plan.jsonl").write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in plan))
    (out / "ledger.jsonl").write_bytes(b"".join(ledger))
    if series:
        rows = [orjson.dumps({"t": t0 + 5 * k, "in_flight": 40 + k % 7, "tok_s": 100.0 + k,
                              "servers": {"http://a": {"kv_usage": 0.5 + k % 5 / 10,
                                                       "running": 30, "waiting": k % 3}}})
                for k in range(30)]
        (out / "timeseries.jsonl").write_bytes(b"\n".join(rows) + b"\n{\"t\": 17")  # torn tail


def test_plots_are_written_as_png_files(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    files = draw_plots(tmp_path / "run", tmp_path / "plots")
    assert sorted(p.name for p in files) == [
        "inflight_kv.png", "output_lengths.png", "throughput.png", "truncation.png"]
    for p in files:
        data = p.read_bytes()
        assert data.startswith(PNG)
        assert len(data) > 10_000  # axes, bars and labels, not an empty canvas


def test_a_run_without_a_time_series_gets_the_other_plots(tmp_path: Path) -> None:
    make_run(tmp_path / "run", series=False)
    files = draw_plots(tmp_path / "run", tmp_path / "plots")
    assert sorted(p.name for p in files) == [
        "output_lengths.png", "throughput.png", "truncation.png"]


def test_nothing_to_plot_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "plan.jsonl").write_bytes(orjson.dumps({"id": "a", "category": "c",
                                                   "partition": "p", "fingerprint": "f"}) + b"\n")
    with pytest.raises(PlotError, match="nothing to plot"):
        draw_plots(out, tmp_path / "plots")


def test_missing_matplotlib_names_the_extra(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(PlotError, match=r"pip install 'draftgen\[plots\]'"):
        draw_plots(tmp_path / "run", tmp_path / "plots")


def test_series_rows_are_sorted_and_bad_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "timeseries.jsonl"
    path.write_bytes(b'{"t": 2, "in_flight": 1}\nnot json\n{"in_flight": 3}\n{"t": 1}\n')
    assert [r["t"] for r in read_series(path)] == [1, 2]
    assert read_series(tmp_path / "missing.jsonl") == []

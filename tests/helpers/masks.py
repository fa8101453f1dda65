"""Reading a loss mask: the runs of token ids it marks for training."""

from __future__ import annotations

from collections.abc import Sequence


def masked_runs(ids: Sequence[int], mask: Sequence[int]) -> list[list[int]]:
    """The stretches of `ids` whose mask is set, in order (one per trained span)."""
    runs: list[list[int]] = []
    prev = 0
    for i, m in zip(ids, mask, strict=True):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(i)
        prev = m
    return runs

"""How many planned samples are done, failed, truncated or pending, per category.

The one count behind `status`, the dataset card and a run's start (what earlier runs left
done or failed). The caller says which ledger entry is a sample's current one: `status`
and the card keep an entry made from the plan's request (`current`); a run keeps those it
will not send again. A planned sample then counts as

- pending, without a current entry;
- done, with a "done" one (its truncation and output tokens counted too), even where the
  entry names no shard (a damaged ledger): the ledger says it is done, only its record
  cannot be read, and readers of records (the card, export) pass over it;
- failed, with any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from draftgen.store.ledger import LedgerEntry


@dataclass(slots=True)
class CategoryTally:
    total: int = 0
    done: int = 0
    failed: int = 0
    truncated: int = 0
    pending: int = 0
    output_tokens: int = 0


T = TypeVar("T", bound=CategoryTally)


@dataclass(slots=True)
class Tally(Generic[T]):
    categories: dict[str, T] = field(default_factory=dict)
    # The entries counted done and failed, in plan order, with the sample's category.
    done: list[tuple[str, LedgerEntry]] = field(default_factory=list)
    failed: list[tuple[str, LedgerEntry]] = field(default_factory=list)


def tally(planned: Iterable[tuple[str, LedgerEntry | None]],
          new: Callable[[], T]) -> Tally[T]:
    """Count each planned sample, given as (its category, its current entry or None);
    `new` makes a category's row (a `CategoryTally`, or one with more to fill in)."""
    counted: Tally[T] = Tally()
    for category, e in planned:
        row = counted.categories.get(category)
        if row is None:
            row = counted.categories[category] = new()
        row.total += 1
        if e is None:
            row.pending += 1
        elif e.status == "done":
            row.done += 1
            row.truncated += e.truncated
            row.output_tokens += e.output_tokens
            counted.done.append((category, e))
        else:
            row.failed += 1
            counted.failed.append((category, e))
    return counted


def current(plan: Iterable[Mapping[str, Any]], entries: Mapping[str, LedgerEntry],
            ) -> Iterator[tuple[str, LedgerEntry | None]]:
    """Each plan row's category, and its ledger entry where that answers the row's request
    (same fingerprint; an entry of an older request is no answer: pending)."""
    for p in plan:
        e = entries.get(p["id"])
        yield p["category"], e if e is not None and e.fingerprint == p["fingerprint"] else None

"""Pausing the cycle collector while bulk-loading acyclic data."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Loading 10^5 rows allocates millions of small acyclic objects, and each allocation
    burst triggers collections that scan everything alive and free nothing; at restart
    that was ~30% of the time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

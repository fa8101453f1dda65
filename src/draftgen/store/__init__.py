"""The output directory: the ledger (what is done) and the shards (the data).

Layout of a run directory::

    manifest.json     job, versions, servers, per-run counts (replaced atomically)
    plan.jsonl        every planned sample: id, category, partition, fingerprint, tokens
    rejected.jsonl    source rows set aside, with file, row and reason
    ledger.jsonl      one line per outcome; the last line for an id wins
    shards/NNNNN.jsonl  full records, each line pointed at by a ledger line

The ledger is the truth. A record is written to its shard (and fsynced) before its ledger
line, so a kill leaves at worst a shard tail the ledger does not mention; opening the store
adopts complete tail records and cuts torn bytes, so nothing is lost or duplicated.
"""

from draftgen.store.ledger import LedgerEntry
from draftgen.store.run_store import RunStore

__all__ = ["LedgerEntry", "RunStore"]

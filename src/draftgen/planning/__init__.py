"""Before a run: which samples (sources → plan: caps, dedup, partitions, ids), what a run
changes in the plan (`replan`), and how long it will take (the capacity model, measured
from a server or a run, and budgets that fit caps to a deadline)."""

"""`draftgen tune`: the fastest server configuration that passes the probe, for one job.

    candidates.py  the grid per engine, from a profile (and its `tune:` section) and a job
    levers.py      a candidate's levers applied to the reference profile
    measure.py     one trial: launch, verify, probe, measure; failures are results
    window.py      a window of the job's own requests against a server
    referee.py     the A/B probe against the reference's recorded answers
    predict.py     the job's predicted duration on a trial's server (the capacity model)
    search.py      successive halving within a budget, resumable
    directory.py   the tune directory: tune.json, tune.jsonl (one trial per line)
    result.py      the table, the best profile written, speed against drift (PNG)
    tuner.py       `tune()`: all of it, for the CLI
"""

from draftgen.tune.result import Row, TuneResult, format_table
from draftgen.tune.tuner import TuneOptions, default_tune_dir, tune

__all__ = ["Row", "TuneOptions", "TuneResult", "default_tune_dir", "format_table", "tune"]

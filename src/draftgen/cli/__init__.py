"""The command line: parse, load the job, call one library function, print.

`app.py` holds the app and what every command shares; `data.py` the commands on a job and
its run directory; `servers.py` those on servers; `errors.py` how any of them fails (one
line, exit 2 or 1, never a traceback).
"""

from draftgen.cli import data, servers
from draftgen.cli.app import app

__all__ = ["app", "data", "main", "servers"]


def main() -> None:
    app()

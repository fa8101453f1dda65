"""Every error draftgen raises, in one tree.

    DraftgenError
    ├── JobError            bad job file or option (the CLI exits 2)
    ├── StoreError          the output directory cannot be used (the CLI exits 2)
    │   ├── JobChangedError done records were made with different requests
    │   └── DiskError       a write failed (ENOSPC, EIO): stop, keep what is complete (exit 1)
    ├── HostError           the machine, not the input: a path it will not let us write,
    │                       a missing optional package (the CLI exits 1)
    └── RequestError        one request failed; `retryable` decides what the runner does
        ├── Transient       may succeed if sent again: 408/429/5xx, broken stream, idle timeout
        │   └── ServerDown  nothing is listening: connection refused or reset, 502/503
        └── Permanent       sending it again cannot help
            ├── BadRequest      400/404/422 and other client errors
            ├── RunError        the whole run, not one sample: refused key, unknown model
            └── ContextTooLong  prompt + max_tokens exceed the server's context

Request errors are decided once, where HTTP meets our code (`client/`), and a final
failure becomes a data row with `reason`, never a crash. The CLI prints any other error
as one line naming the file or field (`error: ...`), never a traceback.
"""

from __future__ import annotations

import errno


class DraftgenError(Exception):
    """Base of every error draftgen raises on purpose."""


class JobError(DraftgenError):
    """The job file or a command-line option is invalid; the message names file and field."""


class StoreError(DraftgenError):
    """The output directory cannot be used as asked."""


class JobChangedError(StoreError):
    """Done records were made from requests that differ from the ones the job now makes."""


class DiskError(StoreError):
    """Writing to the output directory failed; completed work is intact on disk."""


class HostError(DraftgenError):
    """The input is fine but this machine cannot do it: a destination that cannot be written
    (permissions, a read-only or full file system), an optional package not installed."""


# OS errors that say the machine refuses, not that the path given was wrong.
_HOST_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                          errno.EIO})


def path_error(where: str, e: OSError) -> JobError | HostError:
    """`where: <what the OS said>`, as a HostError when the machine refused (permissions, a
    read-only, full or failing disk) and as a JobError when the path itself is wrong."""
    message = f"{where}: {e.strerror or type(e).__name__}"
    return HostError(message) if e.errno in _HOST_ERRNOS else JobError(message)


class RequestError(DraftgenError):
    retryable = False
    reason = "error"

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Transient(RequestError):
    retryable = True
    reason = "transient"


class ServerDown(Transient):
    reason = "server_down"


class Permanent(RequestError):
    reason = "permanent"


class BadRequest(Permanent):
    reason = "bad_request"


class RunError(Permanent):
    """Concerns the whole run, not one sample — a refused API key, a model the server does
    not serve, a URL with no chat endpoint: the run stops at once and no sample is charged."""

    reason = "run_error"


class ContextTooLong(Permanent):
    reason = "context_too_long"

"""Every error draftgen raises, in one tree.

    DraftgenError
    ├── JobError            bad job file or option (the CLI exits 2)
    ├── StoreError          the output directory cannot be used
    │   ├── JobChangedError done records were made with different requests
    │   └── DiskError       a write failed (ENOSPC, EIO): stop, keep what is complete
    └── RequestError        one request failed; `retryable` decides what the runner does
        ├── Transient       may succeed if sent again: 408/429/5xx, broken stream, idle timeout
        │   └── ServerDown  nothing is listening: connection refused or reset, 502/503
        └── Permanent       sending it again cannot help
            ├── BadRequest      400/404/422 and other client errors
            └── ContextTooLong  prompt + max_tokens exceed the server's context

Request errors are decided once, where HTTP meets our code (`client/`), and a final
failure becomes a data row with `reason`, never a crash.
"""

from __future__ import annotations


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

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

`redact` is what every text that quotes a server, a log or a command line goes through
before it is shown or stored: no API key in an error, a log or a record.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable


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


REDACTED = "***"
# A secret shorter than this is not replaced where it stands alone (it would garble the
# text: a one-letter "key" is in every word); the patterns below still hide it.
_MIN_SECRET_CHARS = 4
# Where a key shows itself whatever its value: a launch command line (`--api-key K`,
# `--api-key=K`, or an argv list `'--api-key', 'K'`), an HTTP header (`Bearer K`), and an
# engine's dump of its own arguments (`'api_key': 'K'`, `api_key=K`). A value a JSON text
# leaves unquoted (`"api_key": null`) is no key, and stays: the text stays JSON.
_SECRET_SPOTS = (
    re.compile(r"(--api[-_]key(?:=|\s+|['\"]\s*,\s*['\"]))([^\s'\",\]]+)", re.IGNORECASE),
    re.compile(r"(\bBearer\s+)([^\s'\",}\]]+)", re.IGNORECASE),
    re.compile(r"(\bapi[-_]key['\"]?\s*:\s*\[?\s*['\"])([^'\"]+)", re.IGNORECASE),
    re.compile(r"(\bapi[-_]key=['\"]?)([^\s'\",)]+)", re.IGNORECASE),
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with each of `secrets` (the keys known to be in play) and any key in one of
    the spots above replaced by REDACTED."""
    for secret in sorted({s for s in secrets if s and len(s) >= _MIN_SECRET_CHARS},
                         key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for spot in _SECRET_SPOTS:
        text = spot.sub(lambda m: m.group(1) + REDACTED, text)
    return text

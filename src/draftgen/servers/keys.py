"""A launched server's API key: which one it wants, where secrets hide in a launch, and the
readiness request that carries the key.

A server is launched with a key by `--api-key K` in the profile's `extra_args` or by its
engine's `<ENGINE>_API_KEY` in `env`. Whoever talks to it (readiness, verify, the tune's
probe and window) sends the caller's key (a job's), else that one. A launch's secrets are
its keys and the values of `env` entries named like a key, a token, a secret or a password:
what the launcher writes (command line, state, summary, the log's tail in an error) has
them replaced (`errors.redact`).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from draftgen.engines.common import flag_value
from draftgen.errors import redact
from draftgen.servers.profile import ServerProfile

API_KEY_FLAG = "--api-key"
# Environment entries whose values are secrets, by their names.
_SECRET_ENV = re.compile(r"API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# A readiness answer: a real generation, or not yet (refused while loading, 404 before the
# routes exist, 503 while warming up); any other HTTP status is returned as it is.
READY, NOT_YET = 200, 0


def launch_secrets(profile: ServerProfile) -> tuple[str, ...]:
    """The secrets a launch of `profile` carries: every `--api-key` value of its
    `extra_args`, and the values of its `env` entries named like a key or a token."""
    args = list(profile.extra_args)
    keys = [args[i + 1] for i, a in enumerate(args[:-1]) if a == API_KEY_FLAG]
    keys += [a.split("=", 1)[1] for a in args if a.startswith(API_KEY_FLAG + "=")]
    keys += [v for k, v in profile.env.items() if _SECRET_ENV.search(k)]
    return tuple(dict.fromkeys(k for k in keys if k))


def launch_key(profile: ServerProfile) -> str | None:
    """The API key a server launched from `profile` wants: `--api-key` in `extra_args`,
    else `<ENGINE>_API_KEY` in `env`, else the one `env` entry named `*_API_KEY`."""
    key = flag_value(profile.extra_args, API_KEY_FLAG)
    if key:
        return key
    own = profile.env.get(f"{profile.engine.upper()}_API_KEY")
    if own:
        return own
    named = [v for k, v in profile.env.items() if k.upper().endswith("API_KEY") and v]
    return named[0] if len(named) == 1 else None


def chat_answer(url: str, model: str, key: str | None, timeout_s: float) -> int:
    """A one-token chat completion with the key (where there is one): READY when it
    generated, NOT_YET while the server cannot answer, else the HTTP status (401, 403...)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}],
                       "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = json.load(response)
    except urllib.error.HTTPError as e:
        e.close()
        return e.code if e.code in (401, 403) else NOT_YET
    except (OSError, ValueError):
        return NOT_YET
    return READY if isinstance(reply, dict) and reply.get("choices") else NOT_YET


def refusal(engine: str, url: str, key_sent: bool, status: int) -> str:
    """What a server that refused the key while starting means, and what to do."""
    if key_sent:
        return (f"{engine} at {url} refused the API key sent (HTTP {status}): it was launched "
                "with another one (--api-key in the profile's extra_args, or its "
                "environment); give the job the server's key (api_key_env or api_key_file)")
    return (f"{engine} at {url} wants an API key (HTTP {status}) and none is configured: "
            "give the job its key (api_key_env or api_key_file), or the profile --api-key "
            "in extra_args")


def redacted_json(record: Mapping[str, Any], secrets: Iterable[str | None]) -> bytes:
    """A record as indented JSON, with `secrets` (also as JSON spells them) and any key in a
    spot that shows one replaced."""
    text = json.dumps(record, indent=2, sort_keys=True, default=str)
    known = [s for s in secrets if s]
    return (redact(text, [*known, *(json.dumps(s)[1:-1] for s in known)]) + "\n").encode()

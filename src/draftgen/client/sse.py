"""Server-sent events: raw bytes as they arrive → the payload of each `data:` line.

Deliberately narrower than the full SSE grammar: vLLM and SGLang write every event as one
`data: <json>\\n\\n` line, so each data line is dispatched at once instead of being joined
with its neighbours until a blank line. That saves a buffer per event on the hot path;
a JSON payload split over several data lines would fail to parse and surface as a
malformed stream, not as wrong text. `event:`, `id:`, `retry:` and comment lines carry
nothing the completions API uses and are skipped.
"""

from __future__ import annotations

DONE = b"[DONE]"


class SSEDecoder:
    __slots__ = ("_partial",)

    def __init__(self) -> None:
        # Bytes after the last newline: the start of a line whose end has not arrived.
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the data lines completed by `data`, in order."""
        if self._partial:
            data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out: list[bytes] = []
        for line in lines:
            if line[:5] != b"data:":
                continue
            payload = line[6:] if line[5:6] == b" " else line[5:]
            if payload[-1:] == b"\r":
                payload = payload[:-1]
            out.append(payload)
        return out

    def close(self) -> list[bytes]:
        """Payloads left when the stream ends: a last data line without its newline."""
        rest, self._partial = self._partial, b""
        return self.feed(rest + b"\n") if rest else []

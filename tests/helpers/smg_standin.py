"""A stand-in for the SGLang Model Gateway (`smg launch`), launched as a process by the
unit tests of gateway profiles: it reads the flags draftgen gives (`--host`, `--port`,
`--worker-urls`; the rest are accepted and ignored, smg's own parser reading them is
tests/conformance/test_gateway_argv.py) and answers `GET /workers` in smg 1.13.0's shape,
listing each worker as healthy and ready once its own `/health` answers 200.

Run as `python -m smg launch ...` through a script that calls `main(argv)`; argv is what
follows `python`. `SMG_STANDIN_MODE=crash` exits 1 at once, as smg does on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def main(argv: list[str]) -> None:
    if argv[:3] != ["-m", "smg", "launch"]:
        print(f"{sys.executable}: not `-m smg launch`: {argv[:3]}", file=sys.stderr)
        sys.exit(2)
    parser = argparse.ArgumentParser(prog="smg launch")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--worker-urls", nargs="*", default=[])
    args, _rest = parser.parse_known_args(argv[3:])
    print("smg stand-in argv:", " ".join(argv), flush=True)
    if os.environ.get("SMG_STANDIN_MODE") == "crash":
        print("Error: the stand-in was told to fail", flush=True)
        sys.exit(1)
    urls: list[str] = args.worker_urls

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/workers":
                self.send_error(404)
                return
            rows = [{"id": f"w{i}", "url": u, "is_healthy": _healthy(u), "status": "ready",
                     "runtime_type": "sglang", "labels": {}} for i, u in enumerate(urls)]
            body = json.dumps({"workers": rows, "total": len(rows)}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *a: object) -> None:
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()

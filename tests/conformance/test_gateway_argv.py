"""The gateway draftgen starts, read by smg's own argument parser (the pinned release)."""

from __future__ import annotations

import pytest

from draftgen.gateways.smg.api import SMG_VERSION, gateway_command

launch_router = pytest.importorskip("smg.launch_router", reason="the gateway extra (smg)")


def test_smg_reads_our_gateway_command_as_meant() -> None:
    from importlib.metadata import version

    assert version("smg") == SMG_VERSION  # (smg.version says 1.1.0 in this wheel)
    argv = gateway_command("python", host="127.0.0.1", port=30001, metrics_port=30002,
                           worker_urls=["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                           backend="vllm")
    assert argv[:4] == ["python", "-m", "smg", "launch"]
    args = launch_router.parse_router_args(argv[4:])
    assert args.worker_urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert (args.host, args.port) == ("127.0.0.1", 30001)
    assert (args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 30002)
    # Routing keys pin to one worker only under the manual policy, and the gateway's own
    # overload protection would move a key's request to another worker at 0.8 KV usage.
    assert args.policy == "manual"
    assert args.worker_overload_protection is False
    assert launch_router.parse_router_args([]).worker_overload_protection is not False

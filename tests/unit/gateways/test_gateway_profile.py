"""Gateway profiles (gateways/profile.py): worker profiles and the gateway's settings in
one validated file; every problem one JobError naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from draftgen.errors import JobError
from draftgen.gateways.profile import (
    GatewayProfile,
    gateway_of_workers,
    gateway_profile_hash,
    load_any_profile,
    load_gateway_profile,
)
from draftgen.servers.profile import ServerProfile, load_profile

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "profiles"


def worker(tmp_path: Path, stem: str, **fields: Any) -> str:
    """A worker profile `stem.yaml`, named `stem` unless `fields` say otherwise."""
    data = {"engine": "vllm", "model_path": "/models/tiny", "name": stem, "port": 0, **fields}
    (tmp_path / f"{stem}.yaml").write_text(yaml.safe_dump(data))
    return f"{stem}.yaml"


def gateway(tmp_path: Path, text: str | None = None, **settings: Any) -> Path:
    path = tmp_path / "gw.yaml"
    if text is None:
        data = {"gateway": {"workers": [worker(tmp_path, "a"), worker(tmp_path, "b")],
                            **settings}}
        text = yaml.safe_dump(data)
    path.write_text(text)
    return path


def test_the_example_names_two_pinned_workers_and_the_gateway_settings() -> None:
    profile = load_gateway_profile(EXAMPLES / "local-cpu-gateway.yaml")
    assert profile.server_name == "local-cpu-gateway"
    assert (profile.gateway.host, profile.gateway.port, profile.gateway.metrics_port) == (
        "127.0.0.1", 30000, 0)
    assert [w.server_name for w in profile.workers] == ["local-cpu-worker-0",
                                                        "local-cpu-worker-1"]
    # Each keeps its own core: two busy engines on one core starve each other.
    assert [w.env["VLLM_CPU_OMP_THREADS_BIND"] for w in profile.workers] == ["0", "1"]
    assert profile.backend == profile.workers[0].engine
    assert isinstance(load_any_profile(EXAMPLES / "local-cpu-gateway.yaml"), GatewayProfile)
    assert isinstance(load_any_profile(EXAMPLES / "local-cpu.yaml"), ServerProfile)


def test_paths_resolve_from_the_file_and_workers_live_under_the_gateway(tmp_path: Path
                                                                        ) -> None:
    (tmp_path / "sub").mkdir()
    worker(tmp_path / "sub", "a")
    worker(tmp_path / "sub", "b")
    path = tmp_path / "sub" / "gw.yaml"
    path.write_text(yaml.safe_dump({
        "state_dir": "state", "gateway": {"workers": ["a.yaml", "./b.yaml"],
                                          "python": "../bin/python"}}))
    profile = load_gateway_profile(path)
    assert profile.server_name == "gw"  # the file's stem when no name is given
    assert profile.state_path == tmp_path / "sub" / "state" / "gw"
    assert profile.interpreter == str(tmp_path / "bin" / "python")
    assert [w.source_file for w in profile.workers] == [tmp_path / "sub" / "a.yaml",
                                                        tmp_path / "sub" / "b.yaml"]
    placed = profile.workers_in(profile.state_path)
    assert [w.state_path for w in placed] == [
        tmp_path / "sub" / "state" / "gw" / "workers" / n for n in ("a", "b")]
    assert [w.source_file for w in placed] == [w.source_file for w in profile.workers]


def test_the_hash_follows_the_workers_settings_not_the_bookkeeping(tmp_path: Path) -> None:
    first = gateway_profile_hash(load_gateway_profile(gateway(tmp_path)))
    assert gateway_profile_hash(load_gateway_profile(gateway(tmp_path))) == first
    path = gateway(tmp_path)
    path.write_text(path.read_text() + "name: other\nstate_dir: elsewhere\n")
    assert gateway_profile_hash(load_gateway_profile(path)) == first
    worker(tmp_path, "b", max_running_requests=4)
    assert gateway_profile_hash(load_gateway_profile(path)) != first
    assert gateway_profile_hash(load_gateway_profile(gateway(tmp_path, port=0))) != first


BAD = [
    ("unknown-field", {"gateway": {"workers": ["a.yaml"], "prot": 1}}, ["gateway.prot",
                                                                        "unknown field"]),
    ("engine-at-top", {"engine": "vllm", "gateway": {"workers": ["a.yaml"]}},
     ["engine", "unknown field"]),
    ("no-workers", {"gateway": {"workers": []}}, ["gateway.workers"]),
    ("workers-missing", {"gateway": {"port": 1}}, ["gateway.workers", "Field required"]),
    ("worker-twice", {"gateway": {"workers": ["a.yaml", "a.yaml"]}}, ["listed twice"]),
    ("bad-port", {"gateway": {"workers": ["a.yaml"], "port": 70000}}, ["gateway.port"]),
    ("metrics-on-port", {"gateway": {"workers": ["a.yaml"], "port": 30001,
                                     "metrics_port": 30001}}, ["metrics_port", "30001"]),
    ("bad-name", {"name": "a b", "gateway": {"workers": ["a.yaml"]}}, ["name"]),
    ("missing-worker-file", {"gateway": {"workers": ["a.yaml", "nope.yaml"]}},
     ["gateway.workers.1", "nope.yaml", "cannot read"]),
]


@pytest.mark.parametrize("data, names", [(d, n) for _, d, n in BAD], ids=[i for i, _, _ in BAD])
def test_a_bad_gateway_profile_is_one_line_naming_file_and_field(
    tmp_path: Path, data: dict[str, Any], names: list[str]
) -> None:
    worker(tmp_path, "a")
    path = gateway(tmp_path, yaml.safe_dump(data))
    with pytest.raises(JobError) as excinfo:
        load_gateway_profile(path)
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(str(path))
    for name in names:
        assert name in message


def test_a_worker_problem_names_the_gateway_the_field_and_the_worker_file(tmp_path: Path
                                                                        ) -> None:
    worker(tmp_path, "a")
    (tmp_path / "b.yaml").write_text("engine: vllm\nmodel_path: /m\ntp: 0\n")
    path = gateway(tmp_path, yaml.safe_dump({"gateway": {"workers": ["a.yaml", "b.yaml"]}}))
    with pytest.raises(JobError, match=r"gw.yaml: invalid gateway profile: gateway.workers.1: "
                                       r".*b.yaml: invalid server profile: tp"):
        load_gateway_profile(path)


@pytest.mark.parametrize("b_fields, says", [
    ({"engine": "sglang"}, "workers mix engines (sglang, vllm)"),
    ({"name": "a"}, "are both named 'a'"),
    ({"port": 8001}, "both listen on port 8001"),
])
def test_workers_must_be_one_engine_in_their_own_folders_on_their_own_ports(
    tmp_path: Path, b_fields: dict[str, Any], says: str
) -> None:
    worker(tmp_path, "a", port=8001)
    worker(tmp_path, "b", **b_fields)
    path = gateway(tmp_path, yaml.safe_dump({"gateway": {"workers": ["a.yaml", "b.yaml"]}}))
    with pytest.raises(JobError, match=r"gw.yaml: invalid gateway profile: gateway.workers: ") \
            as excinfo:
        load_gateway_profile(path)
    assert says in str(excinfo.value)


def test_a_worker_may_not_be_a_gateway_profile(tmp_path: Path) -> None:
    inner = gateway(tmp_path)
    inner.rename(tmp_path / "inner.yaml")
    path = gateway(tmp_path, yaml.safe_dump({"gateway": {"workers": ["inner.yaml"]}}))
    with pytest.raises(JobError, match=r"gateway\.workers\.0: inner\.yaml is a gateway profile"):
        load_gateway_profile(path)


def test_a_jobs_workers_entry_becomes_a_gateway_profile_with_every_port_free(tmp_path: Path
                                                                             ) -> None:
    a = load_profile(tmp_path / worker(tmp_path, "a", port=8001))
    b = load_profile(tmp_path / worker(tmp_path, "b", port=8001))  # a run picks free ports
    profile = gateway_of_workers([a, b], name="gateway", where="servers")
    assert (profile.server_name, profile.gateway.port, profile.workers) == ("gateway", 0, (a, b))
    with pytest.raises(JobError, match=r"^servers: workers mix engines"):
        gateway_of_workers([a, load_profile(tmp_path / worker(tmp_path, "c", engine="sglang"))],
                           name="gateway", where="servers")
    with pytest.raises(JobError, match=r"^servers: .* are both named 'a'"):
        gateway_of_workers([a, a], name="gateway", where="servers")

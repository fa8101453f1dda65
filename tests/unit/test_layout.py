"""The package's shape: modules stay small enough to read, or say on line 1 why not.

The import contracts themselves are `lint-imports` in `make lint` (pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest

import draftgen

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

"""scripts/check_docs.py: section references and links across the README and the docs/ pages
(the commands check asks the real CLI; `make lint` runs it on the real documents)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_docs.py"

README = """\
# tool

## Quickstart

Read [the guide](docs/guide.md) and [its tuning part](docs/guide.md#tuning-a-server-tune),
or see Scheduling and Quickstart.
"""

GUIDE = """\
# Scheduling: full speed

## Tuning a server: `tune`

Back to the start: see Quickstart. [Up](#scheduling-full-speed), [next](other.md#other).
"""

OTHER = "# Other\n"


@pytest.fixture(scope="module")
def check_docs() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("check_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    paths = {}
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths[name] = path
    return paths


def problems(check_docs: ModuleType, paths: list[Path]) -> list[str]:
    """Every reference and link problem of the documents, each checked against all."""
    docs = [check_docs.read_document(p) for p in paths]
    found: list[str] = []
    for doc in docs:
        others = [d for d in docs if d is not doc]
        found += check_docs.check_references(doc, others)[0]
        found += check_docs.check_links(doc, others)[0]
    return found


def test_valid_references_and_links_across_files_pass(check_docs: ModuleType,
                                                      tmp_path: Path) -> None:
    p = write(tmp_path, {"README.md": README, "docs/guide.md": GUIDE, "docs/other.md": OTHER})
    assert problems(check_docs, [p["README.md"], p["docs/guide.md"], p["docs/other.md"]]) == []
    readme = check_docs.read_document(p["README.md"])
    assert readme.links == [(5, "docs/guide.md"), (5, "docs/guide.md#tuning-a-server-tune")]
    assert check_docs.check_references(readme, [check_docs.read_document(p["docs/guide.md"])]
                                       ) == ([], 2)


def test_a_broken_cross_file_link_is_reported(check_docs: ModuleType, tmp_path: Path) -> None:
    readme = README + "\nSee also [gone](docs/missing.md) and\n[this](docs/guide.md#no-such).\n"
    p = write(tmp_path, {"README.md": readme, "docs/guide.md": GUIDE, "docs/other.md": OTHER})
    found = problems(check_docs, [p["README.md"], p["docs/guide.md"], p["docs/other.md"]])
    assert len(found) == 2, found
    assert found[0].startswith(f"{p['README.md']}:8: link to docs/missing.md: no file ")
    assert found[1].startswith(f"{p['README.md']}:9: link to docs/guide.md#no-such: ")
    assert "no heading with anchor #no-such" in found[1]


def test_a_link_to_a_file_outside_the_documents_is_read(check_docs: ModuleType,
                                                        tmp_path: Path) -> None:
    p = write(tmp_path, {"README.md": README, "docs/guide.md": GUIDE, "docs/other.md": "# x\n"})
    found = problems(check_docs, [p["README.md"], p["docs/guide.md"]])
    assert len(found) == 1
    assert found[0].startswith(f"{p['docs/guide.md']}:5: link to other.md#other: ")


def test_a_reference_to_a_missing_section_is_reported(check_docs: ModuleType,
                                                      tmp_path: Path) -> None:
    guide = GUIDE + "\nThe rest: see Planning a run.\n"
    p = write(tmp_path, {"README.md": README, "docs/guide.md": guide, "docs/other.md": OTHER})
    found = problems(check_docs, [p["README.md"], p["docs/guide.md"], p["docs/other.md"]])
    assert found == [f"{p['docs/guide.md']}:7: 'see Planning a run' names no section "
                     "(no #, ## or ### heading starts with 'Planning a run')"]


def test_a_section_of_a_document_not_checked_is_not_known(check_docs: ModuleType,
                                                          tmp_path: Path) -> None:
    p = write(tmp_path, {"README.md": README})
    found, checked = check_docs.check_references(check_docs.read_document(p["README.md"]))
    assert checked == 2
    assert found == [f"{p['README.md']}:6: 'see Scheduling' names no section "
                     "(no #, ## or ### heading starts with 'Scheduling')"]


def test_anchors_follow_github(check_docs: ModuleType) -> None:
    assert check_docs.github_anchors([
        "Tuning a server for a job: `draftgen tune`", "The A/B quality probe and its gate",
        "Reliability", "Reliability",
    ]) == {"tuning-a-server-for-a-job-draftgen-tune", "the-ab-quality-probe-and-its-gate",
           "reliability", "reliability-1"}

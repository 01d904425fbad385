"""The docs a user reads name files, tests and modules that exist.

README.md and docs/*.md (less RESULTS.md and HISTORY.md, which record what was measured at the time,
at the commit each section names) point users at paths such as `sao/audit.py` and at tests as
`tests/x.py::test_name`, or as `::test_name` after a path in the same line. A renamed or moved file or
test leaves such a pointer dangling.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in ("RESULTS.md", "HISTORY.md"))]
TOP = ("sao", "flows", "schemas", "benchmarks", "tests", "configs", "examples", "notebooks", "scripts", "docs")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./-]*[\w/])")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)?::(\w+)|(tests/[\w/]+\.py)")


def paths_named(text: str) -> list[tuple[int, str]]:
    """Each repository path ``text`` names, with its line number."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in PATH.finditer(text)]


def named_tests(text: str) -> list[tuple[int, str, str]]:
    """Each ``file::test`` ``text`` names, with its line number; a bare ``::test`` belongs to the last
    file named before it on its line."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        current = None
        for m in TEST_REF.finditer(line):
            if m.group(3):
                current = m.group(3)
            elif m.group(1) or current:
                current = m.group(1) or current
                out.append((number, current, m.group(2)))
    return out


def test_the_reference_finders_read_what_the_docs_write():
    text = ("see `sao/audit.py` and `tests/test_audit.py::test_a_lost_rollout_is_found`, "
            "`::test_a_duplicate_row_and_a_duplicate_issue_are_found`\n(https://example.org/sao/x.py) `tests/reliability/`")
    assert paths_named(text) == [(1, "sao/audit.py"), (1, "tests/test_audit.py"), (2, "tests/reliability/")]
    assert named_tests(text) == [(1, "tests/test_audit.py", "test_a_lost_rollout_is_found"),
                                 (1, "tests/test_audit.py", "test_a_duplicate_row_and_a_duplicate_issue_are_found")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_and_test_a_doc_names_exists(doc: Path):
    text = doc.read_text()
    missing = [f"{doc.name}:{n}: {path}" for n, path in paths_named(text) if not (ROOT / path).exists()]
    for n, path, name in named_tests(text):
        source = ROOT / path
        if not source.exists() or not re.search(rf"^\s*(async )?def {name}\b", source.read_text(), re.M):
            missing.append(f"{doc.name}:{n}: {path}::{name}")
    assert not missing, "\n".join(missing)

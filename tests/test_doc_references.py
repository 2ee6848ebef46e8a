"""Every test the docs cite exists: a `tests/FILE.py::name` in README.md or docs/*.md names a file
of the repository and a test function defined in it, so a renamed or removed test cannot leave a
doc pointing at nothing."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"(tests/[\w/]+\.py)::(\w+)((?:`?, `test_\w+)*)")


def _citations() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        for match in CITED.finditer(doc.read_text()):
            names = [match.group(2), *re.findall(r"test_\w+", match.group(3))]
            found += [(doc.name, match.group(1), name) for name in names]
    return found


def _functions(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_docs_cite_tests():
    assert len(_citations()) >= 15  # docs/bad-inputs.md alone cites more


@pytest.mark.parametrize("doc,path,name", _citations())
def test_a_cited_test_exists(doc, path, name):
    assert (ROOT / path).is_file(), f"{doc} cites {path}, which does not exist"
    assert name in _functions(ROOT / path), f"{doc} cites {path}::{name}, which {path} does not define"

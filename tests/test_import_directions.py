"""The package's layers import downwards only: the sender (`ilcp.encoder`) imports nothing from the
receiver (`ilcp.receiver`), and the receiver nothing from RCLC (`ilcp.rclc`); what both read
(`ilcp.names`: memory placements, snaps) lies below them. No comment or docstring points at a
file outside the repository.

Imports are read from the source with `ast` (those inside functions too), so a late import
cannot hide an upward one."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ilcp"

# (importing package, package it must never import)
FORBIDDEN = [("ilcp.encoder", "ilcp.receiver"), ("ilcp.receiver", "ilcp.rclc")]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file, as absolute dotted names (a relative
    ``from ..x import y`` resolved; ``y`` kept as a possible submodule)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_reader_resolves_relative_imports(tmp_path):
    source = PACKAGE / "encoder" / "spec.py"
    found = imported_modules(source)
    assert "ilcp.encoder.kinds" in found and "ilcp.names" in found


@pytest.mark.parametrize("importer,forbidden", FORBIDDEN)
def test_no_upward_import(importer, forbidden):
    folder = PACKAGE.joinpath(*importer.split(".")[1:])
    offenders = {path.relative_to(ROOT).as_posix(): sorted(m for m in imported_modules(path) if _within(m, forbidden))
                 for path in sorted(folder.rglob("*.py"))}
    offenders = {path: names for path, names in offenders.items() if names}
    assert offenders == {}, f"{importer} must not import {forbidden}: {offenders}"


# a path into a folder that is not the repository's: the machine's work area or a sibling checkout
OUTSIDE = re.compile(r"(?<![\w.])(?:shared/(?:design|spec)/|/work/|\.\./shared)")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


def test_no_comment_cites_a_file_outside_the_repository():
    cited = [f"{path.relative_to(ROOT).as_posix()}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, text in _comments_and_docstrings(path) if OUTSIDE.search(text)]
    assert cited == []


def test_the_outside_pattern_finds_a_citation():
    assert OUTSIDE.search("see shared/design/ARCHITECTURE.md")
    assert not OUTSIDE.search("see docs/architecture.md and configs/shared.yaml")

"""The repository's layout rules: the protocol's three parts have their folders, no module is over
500 lines, no private name crosses a module, no code branches on a handoff variant's name, and the
README stays short (its details live in docs/)."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("ilcp", "ilcp_experiments", "scripts", "benchmarks")
MAX_MODULE_LINES = 500
MAX_FACADE_LINES = 300
MAX_README_LINES = 200
MAX_README_LINE_CHARS = 160


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(path: Path) -> list[str]:
    """``from M import _name`` and imports of private modules (``pkg._mod``) in one file, where M is
    a module of this repository other than the file itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            local = node.level > 0 or module.split(".")[0] in CODE_DIRS
            if not local:
                continue
            names = [a.name for a in node.names]
            if any(_private(part) for part in module.split(".")):
                found.append(f"from {'.' * node.level}{module} import {', '.join(names)}")
            found += [f"from {'.' * node.level}{module} import {n}" for n in names if _private(n)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] in CODE_DIRS and any(_private(p) for p in a.name.split("."))]
    return found


def test_the_protocol_s_three_parts_have_their_folders():
    for part, modules in {"encoder": ("pooling", "compressor", "projector", "slots", "kinds", "spec", "model", "send"),
                          "wire": ("payload", "seal"),
                          "receiver": ("prefix", "prompts", "decoding", "receive")}.items():
        for module in modules:
            assert (REPO / "ilcp" / part / f"{module}.py").is_file(), f"ilcp/{part}/{module}.py is missing"
    assert not (REPO / "ilcp" / "transport.py").exists() and not (REPO / "ilcp" / "babilong.py").exists()


@pytest.mark.parametrize("folder", CODE_DIRS)
def test_no_module_is_over_500_lines(folder):
    long = {str(p.relative_to(REPO)): n for p in _python_files(folder)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_handoff_is_a_facade_under_300_lines():
    lines = len((REPO / "ilcp" / "handoff.py").read_text().splitlines())
    assert lines < MAX_FACADE_LINES, f"ilcp/handoff.py has {lines} lines"


def test_no_private_name_crosses_a_module():
    crossing = {str(p.relative_to(REPO)): found for p in _python_files(*CODE_DIRS, "tests")
                if (found := private_imports(p))}
    assert not crossing, f"private names imported across modules: {crossing}"


def test_the_private_import_reader_sees_one():
    sample = REPO / "tests" / "__layout_sample.py"
    try:
        sample.write_text("from ilcp.lm import _x, y\nfrom .rclc._runtime import LOCK\nimport ilcp.rclc._runtime\n"
                          "from os import _exit\n")
        assert private_imports(sample) == ["from ilcp.lm import _x", "from .rclc._runtime import LOCK",
                                           "ilcp.rclc._runtime"]
    finally:
        sample.unlink()


VARIANTS = "ilcp|prompt_tuned|cold_read_tuned|selection_tuned"
VARIANT_BRANCH = re.compile(rf"""\bvariant\s*(?:==|!=|in|not in)\s*[(\[{{]?\s*["'](?:{VARIANTS})["']""")


def test_no_branch_on_a_variant_s_name():
    branches = [f"{p.relative_to(REPO)}:{i}" for p in _python_files("ilcp")
                for i, line in enumerate(p.read_text().splitlines(), 1) if VARIANT_BRANCH.search(line)]
    assert not branches, f"branches on a variant string (make it a field of the variant): {branches}"


def test_the_readme_is_one_page_of_short_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move details into docs/ and link them"
    long = [i for i, line in enumerate(lines, 1) if len(line) > MAX_README_LINE_CHARS]
    assert not long, f"README.md lines over {MAX_README_LINE_CHARS} characters: {long}"


def test_every_variant_the_config_names_is_described_once():
    from ilcp.config_sections import VARIANTS as NAMES
    from ilcp.training.handoff_stage import VARIANTS, variant_of

    assert tuple(VARIANTS) == NAMES
    assert [v.name for v in VARIANTS.values() if v.reads_encoder] == ["ilcp"]
    with pytest.raises(ValueError, match="unknown variant 'bogus'"):
        variant_of("bogus")

"""docs/architecture.md cannot drift from the code: its module map is the import graph read from
the source of every module under ilcp/, and every default it states in the form
"`section.key` (default `VALUE`)" is the training config's own default.

`python tests/test_architecture_doc.py` rewrites the map after a change of imports."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- imports:begin -->", "<!-- imports:end -->"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in sorted((ROOT / "ilcp").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _owner(name: str, known) -> str | None:
    """The innermost module of the package that `name` (a module or an attribute path) lies in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def module_imports(name: str, path: Path, is_package: bool, known) -> tuple[set[str], set[str]]:
    """The package's modules `name` imports when it is imported, and those its functions import
    only when they run."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    at_import, later = set(), set()

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [_owner(a.name, known) for a in node.names]
        if node.level:  # relative: `from . import x` names the package, `from ..y import x` its parent's y
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else _owner(base, known) for a in node.names]

    def visit(node, into: set) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                into.update(t for t in targets(child) if t and t != name)
            elif isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            else:
                visit(child, later if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else into)

    visit(ast.parse(path.read_text()), at_import)
    return at_import, later - at_import


def module_map() -> str:
    """The map as the doc shows it: one row per module."""
    known = _modules()
    short = lambda n: n.removeprefix("ilcp.") if n != "ilcp" else "ilcp (package)"  # noqa: E731
    rows = ["| module | imports when imported | imports when a function runs |", "|---|---|---|"]
    for name, (path, is_package) in known.items():
        now, later = module_imports(name, path, is_package, known)
        rows.append(f"| `{name}` | {', '.join(short(n) for n in sorted(now)) or '-'} | "
                    f"{', '.join(short(n) for n in sorted(later)) or '-'} |")
    return "\n".join(rows)


def _documented_map(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def test_the_module_map_is_the_code_s_import_graph():
    text = DOC.read_text()
    assert _documented_map(text) == module_map(), (
        "docs/architecture.md's module map differs from the imports: run python tests/test_architecture_doc.py")


def test_the_map_reader_sees_imports_at_import_time_and_in_functions():
    known = _modules()
    now, later = module_imports("ilcp.cli", *known["ilcp.cli"], known)
    assert "ilcp.names" in now and "ilcp.training" in later and "ilcp.training" not in now
    now, _ = module_imports("ilcp.handoff", *known["ilcp.handoff"], known)
    assert {"ilcp.encoder.send", "ilcp.receiver.receive", "ilcp.wire.payload", "ilcp.export"} <= now


DEFAULT = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)` \(default `([^`]*)`\)")


def test_every_default_the_doc_states_is_the_config_s():
    from ilcp.config import TrainConfig

    config = TrainConfig()
    stated = DEFAULT.findall(" ".join(DOC.read_text().split()))
    assert len(stated) >= 8
    for dotted, value in stated:
        node = config
        for part in dotted.split("."):
            node = getattr(node, part)
        assert str(node) == value, dotted


if __name__ == "__main__":
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    DOC.write_text(f"{head}{BEGIN}\n{module_map()}\n{END}{rest.partition(END)[2]}")
    sys.exit(0)

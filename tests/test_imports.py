"""The package's import graph: no module imports itself back through another, anywhere under ilcp/;
the training layer sits below evaluation."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ilcp"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """For each module of ilcp, the ilcp modules its import statements load: ``from X import a``
    names X.a when that is a module, else X (a package's names come from its __init__)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    edges.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_cycle_under_ilcp():
    graph = import_graph()
    assert {"ilcp.training.pipeline", "ilcp.evaluation.registry", "ilcp.rclc.agent"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_training_does_not_import_evaluation():
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("ilcp.training"):
            assert not any(e.startswith("ilcp.evaluation") for e in edges), name


def test_only_export_names_state_dict_keys():
    import re

    # a prefix alone ("pooler."), a formatted key (f"pooler.{k}") or the soft prompt's key
    prefix = re.compile(r"""["'](compressor|projector|pooler)\.(\{\w+\})?["']|["']soft_prompt["']""")
    spelled = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if p.name != "export.py" and prefix.search(p.read_text())]
    assert spelled == []


def test_evaluation_method_families_sit_on_the_registry():
    graph = {name: {e for e in edges if e.startswith("ilcp.evaluation")}
             for name, edges in import_graph().items() if name.startswith("ilcp.evaluation")}
    assert graph["ilcp.evaluation.registry"] == set()
    for family in ("ilcp.evaluation.methods", "ilcp.evaluation.rclc_methods"):
        assert graph[family] == {"ilcp.evaluation.registry"}, family
    assert {"ilcp.evaluation.methods", "ilcp.evaluation.rclc_methods"} <= graph["ilcp.evaluation"]


def test_rclc_imports_only_the_modules_it_may():
    """`ilcp.rclc` stands apart from the rest of the package: outside itself it imports the light
    helpers only (`ilcp.names` for its registry of selectors, `ilcp.engines.build` for the vLLM adapter)."""
    allowed = {"ilcp.compat", "ilcp.checks", "ilcp.io", "ilcp.lm", "ilcp.names", "ilcp.engines.build"}
    found = {name: {e for e in edges if e != "ilcp.rclc" and not e.startswith("ilcp.rclc.")} - allowed
             for name, edges in import_graph().items() if name == "ilcp.rclc" or name.startswith("ilcp.rclc.")}
    assert {name: edges for name, edges in found.items() if edges} == {}
    assert "ilcp.names" in import_graph()["ilcp.rclc.selectors"]


def probe_json(code: str):
    """Run `code` in a fresh interpreter from the repository root; the JSON of its last printed line."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_runtime_handoff_does_not_load_lightning():
    """`ilcp.handoff`, `ilcp.wire.payload` and `ilcp.engines.served` run without the training stack:
    Lightning is loaded by `ilcp.training` alone (its extraction loop and stages)."""
    loaded = probe_json(
        "import json, sys\n"
        "def lightning():\n"
        "    return sorted(m for m in sys.modules if m in ('lightning', 'pytorch_lightning')\n"
        "                  or m.startswith(('lightning.', 'pytorch_lightning.')))\n"
        "import ilcp.handoff, ilcp.wire.payload, ilcp.engines.served\n"
        "runtime = lightning()\n"
        "import ilcp.training.extraction\n"
        "print(json.dumps({'runtime': runtime, 'training': lightning()[:1]}))\n"
    )
    assert loaded["runtime"] == [], f"the runtime imports load {loaded['runtime'][:5]}"
    assert loaded["training"] == ["lightning"]  # the probe sees Lightning where it is loaded


def test_the_runtime_package_does_not_import_the_experiment_drivers():
    """ilcp_experiments (the sweep, the results docs) sits beside the package, outside the wheel:
    no module under ilcp/ names it, and importing the package and its command lines loads none of it."""
    def imported(path: Path) -> set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return ({a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
                | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module})

    named = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                   if any(m.split(".")[0] == "ilcp_experiments" for m in imported(path)))
    assert named == []
    assert probe_json(
        "import json, sys\n"
        "import ilcp, ilcp.handoff, ilcp.cli, ilcp.evaluation, ilcp.evaluation.run, ilcp.evaluation.report\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'ilcp_experiments')))\n"
    ) == []

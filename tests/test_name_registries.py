"""One registry per kind of name (`ilcp.names`): RCLC selectors, evaluation methods (exact names,
families, groups) and memory kinds. Every entry resolves to what uses it; the command line's help
and the config checks read the registry, so a new entry needs no other edit; and no list of a
kind's names is spelled anywhere else under ilcp/ (a copy that would go stale)."""

import ast
from pathlib import Path

import pytest

from ilcp import cli, names
from ilcp.config import load_config
from ilcp.config_sections import CompressorConfig, HandoffConfig
from ilcp.names import Registered, resolve

PACKAGE = Path(__file__).resolve().parent.parent / "ilcp"
REGISTRY = PACKAGE / "names.py"
EXPERIMENTS = PACKAGE.parent / "ilcp_experiments"  # the experiment drivers read the same registry


def flat(text: str) -> str:
    """Help text with its line breaks folded, as one reads it."""
    return " ".join(text.split())


def eval_help() -> str:
    return flat(cli.build_eval_parser().format_help())


# --------------------------------------------------------------------------------------------
# every entry resolves and is what the package uses


def test_every_selector_resolves_to_the_instance_every_user_takes(monkeypatch):
    from ilcp import rclc
    from ilcp.evaluation import kv_relay, make_method, rclc_methods

    assert list(rclc.selectors.BY_NAME) == list(names.SELECTORS)
    assert rclc.selectors.DEFAULT_SELECTOR is rclc.selectors.BY_NAME[names.DEFAULT_SELECTOR]
    assert rclc_methods.SELECTORS is kv_relay.SELECTORS is rclc.selectors.BY_NAME
    assert HandoffConfig().selection_selector == names.DEFAULT_SELECTOR
    with pytest.raises(TypeError) as info:
        rclc.transfer_sync(None, None, "Who owns Cedar?", selector="qsnap")
    text = eval_help()
    for name, entry in names.SELECTORS.items():
        instance = rclc.selectors.BY_NAME[name]
        assert type(instance) is resolve(entry.target) and getattr(rclc.selectors, name) is instance
        assert name in rclc.selectors.__all__ and name in str(info.value)
        assert make_method(f"rclc:{name}:r4").selector is instance
        assert make_method(f"kv_relay:{name}:b16").selector is instance
        assert f"rclc:{name}:r16" in rclc_methods.RCLC_BUDGETS
        assert load_config(None, [f"handoff.selection_selector={name}"]).handoff.selection_selector == name
        assert f"{name} ({entry.help})" in text


def test_every_method_family_and_group_resolves_to_what_the_registry_makes():
    from ilcp import evaluation

    assert evaluation.method_names() == names.method_names()
    text = eval_help()
    for name, entry in names.METHODS.items():
        method = evaluation.make_method(name)
        assert type(method) is resolve(entry.target) and method.name == name
        assert names.unknown_method(name) is None and f"{name} ({entry.help})" in text
    for family, entry in names.METHOD_FAMILIES.items():
        method = evaluation.make_method(f"{family}:cacheback:r4")
        assert type(method) is resolve(entry.target) and method.name == f"{family}:cacheback:r4"
        assert names.unknown_method(f"{family}:cacheback:r4") is None and f"{family}:... ({entry.help})" in text
    groups = evaluation.method_groups()
    assert list(groups) == list(names.METHOD_GROUPS)
    assert groups["default"] == names.DEFAULT_METHODS == evaluation.DEFAULT_METHODS
    for group, entry in names.METHOD_GROUPS.items():
        assert groups[group] == tuple(resolve(entry.target)) and len(groups[group]) >= 1
        assert names.unknown_method(group) is None and f"{group} ({entry.help})" in text
        assert evaluation.expand_method_names([group]) == list(groups[group])


def test_every_memory_kind_resolves_to_the_class_named_by_its_entry():
    from ilcp.encoder import kinds as memory_kinds

    registered = memory_kinds.memory_kinds()
    assert list(registered) == list(names.MEMORY_KINDS) == ["mean", "attention", "concat", "slots", "chunk"]
    for name, entry in names.MEMORY_KINDS.items():
        assert registered[name] is resolve(entry.target) and registered[name].kind == name
        assert memory_kinds.memory_kind_for({"kind": name, **registered[name]().entries()}) == registered[name]()
        config = CompressorConfig(memory=registered[name](), answer_head_weight=0.0)
        assert config.memory.kind == name


# --------------------------------------------------------------------------------------------
# a new entry is one edit: the help and the checks take it


def test_a_new_selector_is_one_entry(monkeypatch):
    with pytest.raises(ValueError, match="handoff.selection_selector must be one of"):
        HandoffConfig(selection_selector="lookahead")
    monkeypatch.setitem(names.SELECTORS, "lookahead", Registered("mine.selectors:Lookahead", "a selector of mine"))
    assert HandoffConfig(selection_selector="lookahead").selection_selector == "lookahead"
    assert "lookahead (a selector of mine)" in eval_help()


def test_a_new_method_family_or_group_is_one_entry(monkeypatch, tmp_path):
    for name in ("summary", "hints:short", "summaries"):
        assert names.unknown_method(name) is not None
    monkeypatch.setitem(names.METHODS, "summary", Registered("mine.methods:Summary", "a summary of the context"))
    monkeypatch.setitem(names.METHOD_FAMILIES, "hints", Registered("mine.methods:Hints", "hints of a length"))
    monkeypatch.setitem(names.METHOD_GROUPS, "summaries", Registered("mine.methods:SUMMARIES", "every summary"))
    for name in ("summary", "hints:short", "summaries"):
        assert names.unknown_method(name) is None
    text = eval_help()
    for line in ("summary (a summary of the context)", "hints:... (hints of a length)", "summaries (every summary)"):
        assert line in text
    args = cli.build_eval_parser().parse_args(["--ckpt", str(tmp_path), "--methods", "summary,hints:short,summaries"])
    assert args.methods == ["summary", "hints:short", "summaries"]


def test_a_new_memory_kind_is_one_entry(monkeypatch, tmp_path):
    from ilcp.config import load_config

    with pytest.raises(ValueError, match="compressor.memory.kind must be one of"):
        load_config(None, ["compressor.memory.kind=recurrent"])
    module = tmp_path / "mine_recurrent.py"
    module.write_text("from dataclasses import dataclass\nfrom typing import ClassVar\n"
                      "from ilcp.encoder.kinds import MemoryKind\nfrom ilcp.settings import setting\n\n"
                      "@dataclass(frozen=True)\nclass Recurrent(MemoryKind):\n"
                      "    kind: ClassVar[str] = 'recurrent'\n"
                      "    state_slots: int = setting(4, 'state vectors', minimum=1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(names.MEMORY_KINDS, "recurrent", Registered("mine_recurrent:Recurrent", "a memory of mine"))
    cfg = load_config(None, ["compressor.memory.kind=recurrent", "compressor.memory.state_slots=2",
                             "compressor.answer_head_weight=0"])
    assert (cfg.compressor.memory.kind, cfg.compressor.memory.state_slots) == ("recurrent", 2)
    with pytest.raises(ValueError, match="compressor.memory.state_slots must be >= 1"):
        load_config(None, ["compressor.memory.kind=recurrent", "compressor.memory.state_slots=0"])


# --------------------------------------------------------------------------------------------
# no copy: a literal list of two or more names of a kind outside the registry fails

# Literal lists of names that are not copies of a registry: a choice of some names for a purpose,
# or the names of another kind that shares spellings with methods (the training variants, whose
# trained weights the same-named methods read). Keyed by file and the constant or function that
# holds the literal.
NOT_COPIES = {
    ("ilcp/config_sections.py", "VARIANTS"): "the training variants",
    ("ilcp/config_sections.py", "DEFAULT_VARIANTS"): "the training variants trained by default",
    ("ilcp/config_sections.py", "DISTILL_TEACHERS"): "the text readers a distillation teacher can be",
    ("ilcp/export.py", "BASELINES"): "the soft-prompt training variants",
    ("ilcp/evaluation/decoders.py", "THROUGHPUT_METHODS"): "the methods whose decode throughput is measured",
    ("ilcp/evaluation/side_sweeps.py", "LENGTH_METHODS"): "the methods of the context-length sweep",
    ("ilcp/evaluation/side_sweeps.py", "FACTS_COUNT_METHODS"): "the methods of the facts-count sweep",
    ("ilcp_experiments/sweep/schema.py", "_SELECTION_FAMILIES"): "the families whose names carry a selector",
    ("ilcp_experiments/sweep/run.py", "TEXT_METHODS"): "the methods that read the context text",
    ("ilcp_experiments/sweep/run.py", "EMPTY_METHODS"): "the methods that carry no context",
    ("ilcp_experiments/sweep/render.py", "_REFERENCE_MARKERS"): "the plot's reference rows",
    ("ilcp_experiments/results_docs/babilong.py", "babilong_targets"): "the rows a results page compares",
}


def kinds() -> dict[str, set[str]]:
    return {
        "selectors": set(names.SELECTORS),
        "methods": {*names.METHODS, *names.METHOD_FAMILIES, *names.METHOD_GROUPS},
        "memory kinds": set(names.MEMORY_KINDS),
    }


def name_lists(source: str) -> list[tuple[str, int, str, list[str]]]:
    """``(holder, line, kind, names)`` for every literal tuple, list, set or dict (its keys) that
    holds two names or more of one kind; the holder is the function around it, else the constant
    (module or class level) it is assigned to."""
    found = []

    def visit(node, holder, in_function=False):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            holder, in_function = node.name, True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not in_function:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            holder = next((t.id for t in targets if isinstance(t, ast.Name)), holder)
        items = (node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                 else [k for k in node.keys if k is not None] if isinstance(node, ast.Dict) else [])
        spelled = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        for kind, known in kinds().items():
            if len(spelled & known) >= 2:
                found.append((holder, node.lineno, kind, sorted(spelled & known)))
        for child in ast.iter_child_nodes(node):
            visit(child, holder, in_function)

    visit(ast.parse(source), "<module>")
    return found


def test_the_copy_finder_finds_literal_lists_only():
    source = '''
"""Selectors: cacheback, qsnap and chunkkv (prose is no copy)."""
FAVOURITES = ("cacheback", "qsnap")
def pick(name):
    """One of "cacheback" or "qsnap"."""
    return name in {"mean": 1, "concat": 2} or name == "rclc" or f"rclc:{name}" in ["rclc:cacheback:r4"]
'''
    assert name_lists(source) == [("FAVOURITES", 3, "selectors", ["cacheback", "qsnap"]),
                                  ("pick", 6, "memory kinds", ["concat", "mean"])]


def test_no_list_of_a_kinds_names_is_spelled_outside_the_registry():
    copies, seen = [], set()
    for path in sorted([*PACKAGE.rglob("*.py"), *EXPERIMENTS.rglob("*.py")]):
        if path == REGISTRY:
            continue
        relative = str(path.relative_to(PACKAGE.parent))
        for holder, line, kind, spelled in name_lists(path.read_text()):
            seen.add((relative, holder))
            if (relative, holder) not in NOT_COPIES:
                copies.append(f"{relative}:{line} ({holder}) spells {kind} {spelled}: read ilcp.names instead")
    assert copies == []
    stale = [key for key in NOT_COPIES if (PACKAGE.parent / key[0]).is_file() and key not in seen]
    assert stale == []

"""The budget-sweep method groups and their plot: one curve per selector through its budgets."""

from ilcp.evaluation.rclc_methods import RCLC_BUDGETS, RCLC_BUDGETS_TUNED, SELECTORS, parse_rclc_name
from ilcp.evaluation.registry import expand_method_names
from ilcp.evaluation.plots import plot_selection_budgets, selection_curves


def _row(em, wire):
    return {"exact_match": em, "exact_match_ci": [max(0.0, em - 0.1), min(1.0, em + 0.1)], "wire_bytes": wire}


def test_the_budget_groups_name_every_selector_at_every_budget():
    assert expand_method_names(["rclc-budgets"]) == list(RCLC_BUDGETS)
    assert expand_method_names(["rclc-budgets-tuned"]) == list(RCLC_BUDGETS_TUNED)
    specs = [parse_rclc_name(n) for n in RCLC_BUDGETS]
    assert {s.selector for s in specs} == set(SELECTORS)
    for selector in SELECTORS:
        ratios = {s.ratio for s in specs if s.selector == selector and s.ratio}
        budgets = {s.budget for s in specs if s.selector == selector and s.budget}
        assert {2, 4, 8, 16} <= ratios and budgets == {16, 32}
    assert all(parse_rclc_name(n).tuned for n in RCLC_BUDGETS_TUNED)


def test_selection_curves_group_rows_by_selector_and_option_and_share_r1():
    methods = {
        "rclc:cacheback:r1": _row(0.5, 4000), "rclc:cacheback:r4": _row(0.2, 1000), "rclc:cacheback:r16": _row(0.1, 300),
        "rclc:qsnap:r4": _row(0.25, 1000), "rclc:qsnap:b16": _row(0.3, 1700),
        "rclc:qsnap:r4:tuned": _row(0.3, 1000),  # alone on its curve: no curve drawn
        "kv_relay:qsnap:r4": _row(0.4, 9000), "cold_read": _row(0.6, 200), "prompt_tuned": _row(0.1, 0),
    }
    curves = selection_curves(methods)
    assert [n for n, _ in curves["rclc:cacheback"]] == ["rclc:cacheback:r16", "rclc:cacheback:r4", "rclc:cacheback:r1"]
    assert [n for n, _ in curves["rclc:qsnap"]] == ["rclc:qsnap:r4", "rclc:qsnap:b16", "rclc:cacheback:r1"]
    assert "rclc:qsnap:tuned" not in curves and "kv_relay:qsnap" not in curves and "cold_read" not in curves


def test_the_report_draws_the_budget_plot_only_when_there_are_curves(tmp_path):
    task = {"n": 60, "seen_in_training": True, "methods": {
        "rclc:cacheback:r1": _row(0.5, 4000), "rclc:cacheback:r4": _row(0.2, 1000), "cold_read": _row(0.6, 200),
        "prompt_tuned": _row(0.1, 0)}}
    assert plot_selection_budgets({"tasks": {"babi:1": task}}, tmp_path / "a.png").stat().st_size > 0
    lone = {"n": 60, "seen_in_training": True, "methods": {"rclc:cacheback:r4": _row(0.2, 1000)}}
    assert plot_selection_budgets({"tasks": {"babi:1": lone}}, tmp_path / "b.png") is None
    assert not (tmp_path / "b.png").exists()

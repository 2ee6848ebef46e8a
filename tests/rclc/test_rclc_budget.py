"""Budget formulas and receiver fitting against hand-computed cases."""

import pytest

from ilcp.rclc import budget as b


@pytest.mark.parametrize(
    "total, inherited, ratio, expected",
    [
        (100, 0, 4, 25),   # ceil(100 / 4)
        (101, 0, 4, 26),   # ceil(101 / 4)
        (10, 0, 1, 10),    # r1 keeps everything
        (1, 0, 16, 1),
        (110, 40, 4, 58),  # 40 inherited + ceil(70 / 4) = 40 + 18
        (40, 40, 4, 40),   # nothing new: the inherited prefix
        (57, 20, 16, 23),  # 20 + ceil(37 / 16) = 20 + 3
    ],
)
def test_relative_budget(total, inherited, ratio, expected):
    assert b.position_budget(total, inherited, ratio=ratio) == expected


@pytest.mark.parametrize("total, cap, expected", [(100, 1024, 100), (2000, 1024, 1024), (5, 5, 5)])
def test_bounded_budget(total, cap, expected):
    assert b.position_budget(total, 37 if total > 37 else 0, budget=cap) == expected


def test_modes():
    assert b.resolve_mode() == b.BudgetMode("ratio", 4)
    assert b.resolve_mode(ratio=16) == b.BudgetMode("ratio", 16)
    assert b.resolve_mode(budget=1024) == b.BudgetMode("budget", 1024)
    with pytest.raises(ValueError, match="not both"):
        b.resolve_mode(ratio=4, budget=10)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            b.resolve_mode(ratio=bad)
    with pytest.raises(TypeError):
        b.resolve_mode(budget=2.5)
    with pytest.raises(TypeError):
        b.resolve_mode(ratio=True)


def test_chain_growth_relative_and_bounded():
    # Hop 1: 80 fresh rows at r4 -> 20. Hop 2: 20 inherited + 60 new -> 20 + 15 = 35.
    first = b.position_budget(80, 0, ratio=4)
    second = b.position_budget(first + 60, first, ratio=4)
    assert (first, second) == (20, 35)
    # Bounded memory stops growing once the cap binds.
    assert b.position_budget(30 + 200, 30, budget=30) == 30


def test_post_selection_reasoning_split():
    # The spec's example: steps=50, reasoning_budget=50, budget=128 -> at most 78 source rows.
    assert b.split_post_selection(500, 0, b.BudgetMode("budget", 128), 50) == (128, 78)
    # Relative: T + N = 100 + 20 = 120 -> ceil(120 / 4) = 30; selector gets 10.
    assert b.split_post_selection(100, 0, b.BudgetMode("ratio", 4), 20) == (30, 10)
    # Inherited: 12 + ceil((60 + 8 - 12) / 4) = 12 + 14 = 26; selector gets 18.
    assert b.split_post_selection(60, 12, b.BudgetMode("ratio", 4), 8) == (26, 18)


def test_protected_count():
    assert b.protected_count(100, 0) == 1
    assert b.protected_count(100, 40) == 41
    assert b.protected_count(40, 40) == 40


def test_handoff_space_and_tightest_receiver():
    assert b.handoff_space(4096, 50, 128) == 3918
    assert b.tightest([None, 300, 120, None]) == 120
    assert b.tightest([None, None]) is None


def test_fit_unchanged_when_the_sum_fits():
    demands = [b.Demand(25, 1), b.Demand(40, 11)]
    assert b.fit_budgets(demands, 65) == [25, 40]
    assert b.fit_budgets(demands, None) == [25, 40]


def test_fit_shares_equally_and_redistributes():
    # Space 60; floors 1 + 1 + 5 = 7; 53 left over caps (99, 19, 95): 18, 18, 17 in list order.
    demands = [b.Demand(100, 1), b.Demand(20, 1), b.Demand(100, 5)]
    assert b.fit_budgets(demands, 60) == [19, 19, 22]
    # A short sender's unused share goes to the others: caps (4, 99, 99), 50 left -> 4, 23, 23.
    demands = [b.Demand(5, 1), b.Demand(100, 1), b.Demand(100, 1)]
    assert b.fit_budgets(demands, 53) == [5, 24, 24]
    # Remainder in sender order: 10 left over caps (99, 99, 99) -> 4, 3, 3.
    demands = [b.Demand(100, 1)] * 3
    assert b.fit_budgets(demands, 13) == [5, 4, 4]


def test_fit_reserves_reasoning_rows():
    # Floors: 1 + 10 and 1 + 10; 30 - 22 = 8 left -> 4 each: 15 and 15 (selectors get 5 and 5).
    demands = [b.Demand(60, 1, 10), b.Demand(60, 1, 10)]
    assert b.fit_budgets(demands, 30) == [15, 15]


def test_fit_impossible():
    with pytest.raises(ValueError, match="room for 10"):
        b.fit_budgets([b.Demand(50, 6), b.Demand(50, 6)], 10)
    with pytest.raises(ValueError, match="cannot hold"):
        b.fit_budgets([b.Demand(5, 4, 2)], None)
    with pytest.raises(ValueError, match="room for -3"):
        b.fit_budgets([b.Demand(5, 1)], -3)


def test_share_equally():
    assert b.share_equally([2, 10, 10], 13) == [2, 6, 5]
    assert b.share_equally([0, 5], 5) == [0, 5]
    assert b.share_equally([3, 3], 100) == [3, 3]

"""Budget arithmetic, free of models and tensors so every rule can be checked by hand.

Per sender and request the selector gets a position budget:

    relative, ratio=r:   I + ceil((T - I) / r)
    bounded, budget=B:   min(B, T)

where T is the sender's total rows and I its inherited prefix. With reasoning after selection
and reasoning_budget=N, the formula is applied to T + N and N rows of it are reserved for the
rows reasoning appends, so the selector gets the rest.

When receivers cannot hold every sender's budget, `fit_budgets` shares the handoff space: each
sender keeps its protected positions (and reserved reasoning rows), and the remaining space is
shared equally, with unused shares of short senders redistributed; remainders go to senders
in list order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ilcp.checks import positive_int

DEFAULT_RATIO = 4


@dataclass(frozen=True)
class BudgetMode:
    """How a sender's budget is set: ``kind`` is "ratio" or "budget"; ``value`` a positive int."""

    kind: str
    value: int

    def positions(self, total: int, inherited: int = 0) -> int:
        """The position budget for ``total`` rows of which ``inherited`` lead (see module docstring)."""
        return position_budget(total, inherited, **{self.kind: self.value})


def _positive_int(value, name: str) -> int:
    """`ilcp.checks.positive_int`, except that a value of another type (a bool, a float) raises TypeError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    return positive_int(name, value)


def resolve_mode(ratio: int | None = None, budget: int | None = None) -> BudgetMode:
    """The budget mode from transfer's options: r4 when neither is given; both is an error."""
    if ratio is not None and budget is not None:
        raise ValueError("pass ratio=... or budget=..., not both")
    if budget is not None:
        return BudgetMode("budget", _positive_int(budget, "budget"))
    if ratio is not None:
        return BudgetMode("ratio", _positive_int(ratio, "ratio"))
    return BudgetMode("ratio", DEFAULT_RATIO)


def position_budget(total: int, inherited: int = 0, *, ratio: int | None = None, budget: int | None = None) -> int:
    """Relative: ``I + ceil((T - I) / ratio)``; bounded: ``min(budget, T)``.

    Raises:
        ValueError: both or neither mode, non-positive values, or ``inherited`` outside [0, total].
    """
    if (ratio is None) == (budget is None):
        raise ValueError("position_budget needs exactly one of ratio=... and budget=...")
    if total < 0 or not 0 <= inherited <= total:
        raise ValueError(f"need 0 <= inherited <= total, got inherited={inherited}, total={total}")
    if budget is not None:
        return min(_positive_int(budget, "budget"), total)
    ratio = _positive_int(ratio, "ratio")
    return inherited + -(-(total - inherited) // ratio)


def split_post_selection(total: int, inherited: int, mode: BudgetMode, reasoning_budget: int) -> tuple[int, int]:
    """Budgets when reasoning runs after selection: (message budget, selector budget).

    The formula is applied to ``total + reasoning_budget``; ``reasoning_budget`` rows of the result
    are reserved for appended rows. Example: bounded 128, N=50, T=500 -> (128, 78).
    """
    n = _positive_int(reasoning_budget, "reasoning_budget")
    message = mode.positions(total + n, inherited)
    return message, message - n


def protected_count(total: int, latent_steps: int) -> int:
    """Positions built-in selectors always keep: position 0 and the latent tail."""
    if not 0 <= latent_steps <= total:
        raise ValueError(f"latent_steps={latent_steps} outside [0, {total}]")
    return latent_steps + (1 if total > latent_steps else 0)


def handoff_space(context_limit: int, prompt_positions: int, output_positions: int) -> int:
    """Positions a receiver has for received rows: its context limit minus prompt and output."""
    return context_limit - prompt_positions - output_positions


def tightest(spaces: Iterable[int | None]) -> int | None:
    """The smallest handoff space among receivers; None (no limit) when none declares one."""
    known = [s for s in spaces if s is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class Demand:
    """One sender's claim on a request's handoff space.

    Attributes:
        maximum: the relative or bounded budget (message rows, reserved reasoning included).
        protected: positions the selector must keep (built-ins: position 0 and the latent tail;
            custom selectors: a floor of 1).
        reserved: rows reserved for reasoning after selection.
    """

    maximum: int
    protected: int
    reserved: int = 0

    @property
    def floor(self) -> int:
        return self.protected + self.reserved


def fit_budgets(demands: list[Demand], space: int | None) -> list[int]:
    """Message budgets for senders sharing one request's handoff ``space`` (None: unlimited).

    Returns each sender's budget (reserved reasoning rows included; the selector gets
    ``budget - reserved``).

    Raises:
        ValueError: a sender's maximum is below its floor, or the space cannot hold every floor.
    """
    if not demands:
        raise ValueError("no senders to fit")
    for i, d in enumerate(demands):
        if d.maximum < d.floor:
            raise ValueError(
                f"sender {i}: a budget of {d.maximum} positions cannot hold its {d.protected} required "
                f"positions plus {d.reserved} reserved reasoning rows"
            )
    maxima = [d.maximum for d in demands]
    if space is None or sum(maxima) <= space:
        return maxima
    floors = [d.floor for d in demands]
    if sum(floors) > space:
        raise ValueError(
            f"the receivers have room for {space} received positions, fewer than the {sum(floors)} "
            "positions the senders must keep (protected positions and reserved reasoning rows)"
        )
    extra = share_equally([m - f for m, f in zip(maxima, floors)], space - sum(floors))
    return [f + e for f, e in zip(floors, extra)]


def share_equally(capacities: list[int], amount: int) -> list[int]:
    """Split ``amount`` equally with per-entry caps, redistributing what capped entries leave.

    Remainders go to the earliest uncapped entries. Example: caps [2, 10, 10], amount 13 ->
    [2, 6, 5].
    """
    shares = [0] * len(capacities)
    active = [i for i, c in enumerate(capacities) if c > 0]
    while active and amount > 0:
        base, rem = divmod(amount, len(active))
        capped = [i for i in active if capacities[i] <= base]
        if not capped:
            for k, i in enumerate(active):
                shares[i] = base + (1 if k < rem else 0)
            return shares
        for i in capped:
            shares[i] = capacities[i]
            amount -= capacities[i]
        active = [i for i in active if i not in capped]
    return shares

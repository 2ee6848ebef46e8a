"""The RCLC rows of the protocol table: ``rclc:<selector>:r<N>`` and ``rclc:<selector>:b<N>``.

    rclc:cacheback:r4          cacheback selection, relative budget ceil(T / 4), in-prompt rows
    rclc:qsnap:b16             qsnap selection, at most 16 positions, in-prompt rows
    rclc:cacheback:r4:prefix   the same rows before the receiver's rendered question prompt
    rclc:chunkkv:r16:tuned     cold_read_tuned's K vectors, then the in-prompt rows
    rclc:cacheback:r4:selection_tuned   selection_tuned's K vectors, then the in-prompt rows

Selectors: the names of `ilcp.names.SELECTORS` (`ilcp.rclc.selectors`). Budgets: ``r<N>`` is
the relative budget ``ceil(T / N)`` of a T-row sender, ``b<N>`` the bounded budget
``min(N, T)`` (`ilcp.rclc.budget`); N >= 1.

Sender (timed as sender time): `ilcp.rclc.sender_from_hf` builds the sender's state from the
context text (no special tokens; one prefill), then `ilcp.rclc.transfer_sync` selects rows for
the question with the method's selector and budget and delivers them to a callback that keeps
the `Delivery`: that is what crosses the handoff. Its bytes are the selected rows in the LM's
dtype: wire bytes = tensor bytes = ``Delivery.nbytes`` (rows x hidden x element size; no
framing is counted).

Receiver (timed as receiver time): the shipped `ilcp.rclc.HFReceiver`, built once per method
from the prompt texts of `ilcp.receiver.prompts` (`receiver_framing`), takes the delivery
(``receiver(delivery)``) and ``receiver.pop()`` returns the inputs whose ``inputs_embeds`` are
the prefix:

- in-prompt (the default, ``placement="in_prompt"``): the rows where the context text sits in
  the cold-read prompt: the system message as chat history, the cold-read user turn as the slot
  template;
- ``:prefix`` (``placement="prefix"``, the RCLC spec's placement): the rows before the rendered
  question prompt (``pop(prompt=...)`` with the question turn, so the selection still sees the
  question alone);
- ``:tuned``: ``cold_read_tuned``'s K trained vectors, then the in-prompt inputs. HFReceiver has
  no soft-prompt input, so the K vectors are put in front of the ``inputs_embeds`` it returns,
  and its context limit is the model's minus K so that its length check counts them. The method
  is skipped for a run without those weights.
- ``:selection_tuned``: the same with ``selection_tuned``'s K vectors, trained in front of these
  in-prompt rows rather than the context text (``handoff.variants`` with selection_tuned; its
  training prompts are `selection_prompt_ids`, the rows of ``handoff.selection_selector`` at
  ``r<handoff.selection_ratio>``, cacheback r4 by default). Other selectors and budgets run too,
  but only the trained one is the layout its vectors saw.

The slot boundary: a byte-level BPE tokenizer (GPT-2 style pre-tokenisation, as SmolLM2's and
Qwen's) reads the space after ``"Context:"`` as the start of the context's first word, so the
sender holds ``" " + context`` and the slot template drops that space (``"Context:{context}"``).
The sender's rows are then the context's tokens exactly as the cold-read prompt tokenises them,
and with in-prompt placement ``r1`` (every row selected, whatever the selector) gives the cold
read's prefix: the ratios measure selection alone.

The sender hands the delivery to a callback rather than to the receiver itself, because the
evaluation times the two sides apart and each `Sent` must stand alone; the receiver's budget
fitting (which only shrinks a budget whose rows would not fit in the receiver's context) is
therefore not applied, and ``pop`` raises ValueError for rows that do not fit.

Groups for ``--methods`` (registered in `ilcp.names.METHOD_GROUPS`, expanded by
`ilcp.evaluation.registry.expand_method_names`): ``rclc`` is
`RCLC_METHODS`; ``rclc-quick`` is `RCLC_QUICK`; ``rclc-budgets`` is `RCLC_BUDGETS` (every
selector at r16, r8, r4, r2, b16 and b32, and r1) and ``rclc-budgets-tuned`` the same rows with
``:tuned``. With two budgets or more of one selector, the report adds ``selection_budgets.png``
(`ilcp.evaluation.plots.plot_selection_budgets`).
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import rclc
from ..rclc.hf import context_limit
from ..receiver.rclc_prompts import ReceiverFraming, receiver_framing
from ..selection_prompts import SELECTORS, selection_prompt_ids
from .registry import EvalContext, HandoffMethod, MethodUnavailable, Prefixes, Sent

__all__ = ["RCLCMethod", "RCLCSpec", "RCLC_METHODS", "RCLC_QUICK", "ReceiverFraming", "SELECTORS", "parse_rclc_name",
           "receiver_framing", "selection_prompt_ids"]

FAMILY = "rclc"
OPTIONS = ("prefix", "tuned", "selection_tuned")
TUNED_SOFT_PROMPT = "cold_read_tuned"
SELECTION_SOFT_PROMPT = "selection_tuned"

# Every selector keeps every row at r1 (the budget holds the whole sender), so one r1 row
# stands for all of them: rclc:qsnap:r1 and rclc:chunkkv:r1 give the same prefixes. bAbI task 1
# contexts hold about 39 SmolLM2 tokens (12 to 69 over the first 200 test questions), so b16
# sits between r4 and r1 (b32 would keep every row of 80 of those 200 contexts).
RCLC_METHODS = (
    "rclc:cacheback:r1",
    *(f"rclc:{s}:{b}" for s in SELECTORS for b in ("r4", "r16", "b16")),
    "rclc:cacheback:r4:prefix",
    "rclc:cacheback:r4:tuned",
)
RCLC_QUICK = ("rclc:cacheback:r1", "rclc:cacheback:r4", "rclc:cacheback:r4:tuned")
# The budget sweep: every selector from r16 to r2 and at b16 and b32, zero-shot, one r1 row for all.
BUDGETS = ("r16", "r8", "r4", "r2", "b16", "b32")
RCLC_BUDGETS = ("rclc:cacheback:r1", *(f"rclc:{s}:{b}" for s in SELECTORS for b in BUDGETS))
RCLC_BUDGETS_TUNED = tuple(f"{name}:tuned" for name in RCLC_BUDGETS)

_BUDGET = re.compile(r"([rb])([0-9]+)")
_USAGE = "use rclc:<selector>:r<N> or rclc:<selector>:b<N>[:prefix|:tuned|:selection_tuned], e.g. rclc:cacheback:r4"


@dataclass(frozen=True)
class RCLCSpec:
    """A parsed ``rclc:...`` name.

    Attributes:
        selector: a name of `ilcp.names.SELECTORS`.
        ratio: N of ``r<N>``, or None.
        budget: N of ``b<N>``, or None (exactly one of ratio and budget is set).
        placement: "in_prompt" (the default) or "prefix".
        tuned: whether cold_read_tuned's K vectors come first.
        selection_tuned: whether selection_tuned's K vectors come first.
    """

    selector: str
    ratio: int | None
    budget: int | None
    placement: str = "in_prompt"
    tuned: bool = False
    selection_tuned: bool = False

    @property
    def soft_prompt(self) -> str | None:
        """The export entry of the K vectors placed first, or None."""
        return TUNED_SOFT_PROMPT if self.tuned else SELECTION_SOFT_PROMPT if self.selection_tuned else None


def parse_selection_name(name: str, family: str, usage: str, unit: str) -> tuple[str, str, int, list[str]]:
    """``(selector, "r" or "b", N, options)`` of ``<family>:<selector>:<r|b><N>[:option...]``, the
    shape of the RCLC and KV relay rows' names (`unit`: what a budget counts, for messages).

    Raises:
        ValueError: another family, a missing or unknown selector, a missing or malformed budget, N < 1.
    """
    if not isinstance(name, str):
        raise ValueError(f"method name must be a string, got {name!r}")
    parts = name.strip().split(":")
    if parts[0] != family:
        raise ValueError(f"{name!r} is not {'an' if family[0] in 'aeiou' else 'a'} {family} method name: {usage}")
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"{name!r}: missing selector ({', '.join(sorted(SELECTORS))}); {usage}")
    if parts[1] not in SELECTORS:
        raise ValueError(f"{name!r}: unknown selector {parts[1]!r}; known: {', '.join(sorted(SELECTORS))}")
    if len(parts) < 3 or not parts[2]:
        raise ValueError(f"{name!r}: missing budget (r<N>: relative, ceil(T / N) {unit}; b<N>: at most N {unit}); "
                         f"{usage}")
    match = _BUDGET.fullmatch(parts[2])
    if match is None:
        raise ValueError(f"{name!r}: budget {parts[2]!r} is neither r<N> (relative) nor b<N> (bounded); {usage}")
    value = int(match.group(2))
    if value < 1:
        raise ValueError(f"{name!r}: budget {parts[2]!r} must have N >= 1")
    return parts[1], match.group(1), value, parts[3:]


def parse_rclc_name(name: str) -> RCLCSpec:
    """Parse ``rclc:<selector>:<r|b><N>[:prefix|:tuned|:selection_tuned]``.

    Raises:
        ValueError: another family, a missing or unknown selector, a missing or malformed budget,
            N < 1, an unknown or repeated option, ``:prefix`` with ``:tuned`` or
            ``:selection_tuned``, or both of those.
    """
    selector, kind, value, options = parse_selection_name(name, FAMILY, _USAGE, "rows")
    for option in options:
        if option not in OPTIONS:
            raise ValueError(f"{name!r}: unknown option {option!r}; options: {', '.join(':' + o for o in OPTIONS)}")
    if len(set(options)) != len(options):
        raise ValueError(f"{name!r}: an option is repeated")
    if "tuned" in options and "selection_tuned" in options:
        raise ValueError(f"{name!r}: ':tuned' and ':selection_tuned' each put K vectors first; choose one")
    for tuned, variant in (("tuned", TUNED_SOFT_PROMPT), ("selection_tuned", SELECTION_SOFT_PROMPT)):
        if "prefix" in options and tuned in options:
            raise ValueError(f"{name!r}: ':{tuned}' places the rows in the prompt (the layout {variant} was trained "
                             "with); it does not combine with ':prefix'")
    return RCLCSpec(selector=selector, ratio=value if kind == "r" else None, budget=value if kind == "b" else None,
                    placement="prefix" if "prefix" in options else "in_prompt", tuned="tuned" in options,
                    selection_tuned="selection_tuned" in options)


SENDER_STATES = "rclc_sender_states"


class SenderStates:
    """Sender states by sender text, built on first use with `ilcp.rclc.sender_from_hf`; the
    oldest are dropped beyond `capacity` states or `max_positions` cached positions in all (a
    state holds its context's KV cache: about 46 kB a position for SmolLM2 in float32, so the
    default bound is about 3 GB; 200 contexts of 2k tokens would hold 19 GB). A dropped state is
    built again when asked for.

    Attributes:
        built: how many states were built (a test reads it).
    """

    def __init__(self, lm, capacity: int = 512, max_positions: int = 65536):
        self.lm, self.capacity, self.max_positions, self.built = lm, capacity, max_positions, 0
        self._states: OrderedDict[str, rclc.SenderState] = OrderedDict()
        self._positions = 0
        self._selections: dict[str, dict[tuple, rclc.Delivery]] = {}  # by text: (selector, budget, question)
        self._profiles: dict[str, dict[tuple, object]] = {}  # by text: (selector, question)
        self.selected = self.profiled = 0  # selections and attention passes made (tests read them)

    def selector(self, text: str, name: str, selector, question: str):
        """``selector`` with its attention pass over ``text``'s state for ``question`` made once
        while the state is held, whatever the budget: a built-in selector scores positions from
        one pass (`Selector.profile`) and only then cuts to the budget, so the rows of r4, r8 and
        r16 share it. Anything else is returned as it is."""
        if not rclc.selectors.is_builtin(selector):
            return selector
        held = self._profiles.setdefault(text, {})
        key = (name, question)
        shared = copy.copy(selector)

        def profile(sender, request_ids):
            if key not in held:
                held[key] = selector.profile(sender, request_ids)
                self.profiled += 1
            return held[key]

        shared.profile = profile
        return shared

    def selection(self, text: str, key: tuple, select: Callable[[rclc.SenderState], rclc.Delivery]) -> rclc.Delivery:
        """The delivery ``select`` makes from ``text``'s state, made once per ``key`` while the
        state is held: rows that differ only in what the receiver puts before the rows (``:tuned``)
        share the selection (selectors are deterministic and work on a clone of the cache)."""
        state = self.get(text)
        held = self._selections.setdefault(text, {})
        if key not in held:
            held[key] = select(state)
            self.selected += 1
        return held[key]

    def get(self, text: str) -> rclc.SenderState:
        state = self._states.get(text)
        if state is None:
            state = rclc.sender_from_hf(self.lm.model, self.lm.tokenizer, text)
            self.built += 1
            self._states[text] = state
            self._positions += state.positions
            while len(self._states) > 1 and (len(self._states) > self.capacity
                                             or self._positions > self.max_positions):
                dropped, old = self._states.popitem(last=False)
                self._positions -= old.positions
                self._selections.pop(dropped, None)
                self._profiles.pop(dropped, None)
        else:
            self._states.move_to_end(text)
        return state


def sender_states(ctx: EvalContext) -> SenderStates:
    """The evaluation's one `SenderStates` (kept in the context's extras), shared by every RCLC
    and kv_relay row."""
    if SENDER_STATES not in ctx.extras:
        ctx.extras[SENDER_STATES] = SenderStates(ctx.lm)
    return ctx.extras[SENDER_STATES]


class RCLCMethod(HandoffMethod):
    """One RCLC row: selected sender rows at a budget, placed by `ilcp.rclc.HFReceiver`.

    ``send`` returns a `Sent` whose ``handed_over`` is the `ilcp.rclc.Delivery` (rows, not
    bytes); ``receive`` returns the (L, H) prefix described in the module docstring.
    """

    shares_sender_states = True

    def __init__(self, name: str):
        super().__init__(name)
        self.spec = parse_rclc_name(name)
        self.selector = SELECTORS[self.spec.selector]
        self.requires = (self.spec.soft_prompt,) if self.spec.soft_prompt else ()
        self.framing: ReceiverFraming | None = None
        self.receiver: rclc.HFReceiver | None = None
        self._soft: Tensor | None = None

    def bind(self, ctx: EvalContext) -> None:
        super().bind(ctx)
        soft = self.spec.soft_prompt
        if soft is not None and soft not in ctx.run.soft_prompts:
            raise MethodUnavailable(f"{self.name}: the run has no {soft} weights")
        model, tokenizer = ctx.lm.model, ctx.lm.tokenizer
        self._soft = ctx.run.soft_prompts[soft] if soft is not None else None
        limit = context_limit(model) - (self._soft.shape[0] if self._soft is not None else 0)
        if limit < 1:
            raise ValueError(f"{self.name}: {soft}'s {self._soft.shape[0]} vectors leave no room "
                             f"in the model's {context_limit(model)} positions")
        self.framing = receiver_framing(tokenizer)
        self.receiver = rclc.HFReceiver(model, tokenizer, messages=self.framing.messages,
                                        max_new_tokens=ctx.max_new_tokens, context_limit=limit,
                                        placement=self.spec.placement, slot_template=self.framing.slot_template)

    def sender_text(self, context: str) -> str:
        """The text the sender's state is built from: the context as the cold-read prompt holds it."""
        if self.framing is None:
            raise RuntimeError(f"method {self.name!r} is not bound to a run: call bind(ctx) first")
        return self.framing.lead + context.strip()

    def send(self, row: dict) -> Sent:
        lm = self.lm
        return self._select(rclc.sender_from_hf(lm.model, lm.tokenizer, self.sender_text(row["context"])), row)

    def build_prefixes(self, rows) -> Prefixes:
        """The accuracy path: as `send` and `receive` row by row, but each context's sender state is
        built once for every RCLC method and budget of the evaluation (`SenderStates`, kept in the
        context's extras): selectors work on a clone of the state's cache, so sharing it changes
        no row. The timed path (`send`) still builds its own."""
        states = sender_states(self.ctx)
        key = (self.spec.selector, self.spec.ratio, self.spec.budget)
        sent = []
        for r in rows:
            text, question = self.sender_text(r["context"]), r["question"].strip()
            selector = states.selector(text, self.spec.selector, self.selector, question)
            sent.append(self._sent(states.selection(text, (*key, question),
                                                    lambda state, r=r: self._deliver(state, r, selector))))
        return Prefixes(prefixes=[self.receive(s, r) for s, r in zip(sent, rows)],
                        wire_bytes=[s.wire_bytes for s in sent], tensor_bytes=[s.tensor_bytes for s in sent])

    def _select(self, state: rclc.SenderState, row: dict) -> Sent:
        return self._sent(self._deliver(state, row))

    def _deliver(self, state: rclc.SenderState, row: dict, selector=None) -> rclc.Delivery:
        deliveries: list[rclc.Delivery] = []
        rclc.transfer_sync(state, deliveries.append, row["question"].strip(), ratio=self.spec.ratio,
                           budget=self.spec.budget, selector=self.selector if selector is None else selector)
        return deliveries[0]

    @staticmethod
    def _sent(delivery: rclc.Delivery) -> Sent:
        return Sent(handed_over=delivery, wire_bytes=delivery.nbytes, tensor_bytes=delivery.nbytes)

    def receive(self, sent: Sent, row: dict) -> Tensor:
        if self.receiver is None:
            raise RuntimeError(f"method {self.name!r} is not bound to a run: call bind(ctx) first")
        if not isinstance(sent.handed_over, rclc.Delivery):
            raise ValueError(f"{self.name}: expected an ilcp.rclc.Delivery, got {type(sent.handed_over).__name__}")
        prompt = self.framing.question_turn(row["question"]) if self.spec.placement == "prefix" else None
        self.receiver(sent.handed_over)
        try:
            inputs = self.receiver.pop(prompt=prompt)
        except Exception:
            self.receiver.consume_next()
            raise
        prefix = inputs["inputs_embeds"][0]
        if self._soft is not None:
            prefix = torch.cat([self._soft.to(device=prefix.device, dtype=prefix.dtype), prefix], dim=0)
        return prefix

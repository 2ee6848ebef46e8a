"""`transfer` / `transfer_sync`: select sender rows under a budget and deliver them.

The pipeline, for one call:

1. validate options, senders, receivers and requests; check HF receivers against every sender
   and render their prompts (one snapshot per receiver and request);
2. reasoning before selection ("full": once per sender; "full_with_request": per request);
3. plan every request's budgets (relative or bounded, then fitted to the tightest receiver);
4. select (once per sender and request), reason after selection if asked, build messages;
5. only then call the receivers: request order, then receiver-list order.

Any failure in 1-4 delivers nothing. A receiver's exception propagates at once; earlier
deliveries stay. Model work runs in worker threads under one process-wide lock; cancelling
waits for the running worker, then raises CancelledError.

Extension points for other sender and receiver kinds (bound agents, other backends):
a sender may be any object with ``sender_state()`` (sync or async) returning a SenderState
(``_rclc_sender_state()``, when present, is preferred: `Agent` prefills there in a worker); a
receiver that takes part in budget fitting implements the `RowReceiver` protocol
(`ilcp.rclc.receiver`), as `HFReceiver` and `Agent` do.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ilcp.checks import positive_int
from ilcp.rclc import budget as budget_rules
from ilcp.rclc import hf
from ilcp.rclc.runtime import require_no_running_loop, run_in_worker
from ilcp.rclc.message import REPRESENTATIONS, Delivery, Message
from ilcp.rclc.reasoning import REASONING_CONTEXTS, run_method
from ilcp.rclc.receiver import ReceiverPlan, RowReceiver
from ilcp.rclc.record import record_selection as build_record
from ilcp.rclc.selectors import BY_NAME, DEFAULT_SELECTOR, is_builtin, validate_positions
from ilcp.rclc.state import SenderState, rows_match_ids


@dataclass
class _Route:
    """Everything prepared for one (request, sender) pair."""

    state: SenderState  # the state the selector sees
    request_ids: torch.Tensor  # int64 [1, R] in the sender's vocabulary
    budget: int = 0  # fitted message budget
    positions: torch.Tensor | None = None
    message: Message | None = None


def _items(value, name: str) -> list:
    if isinstance(value, (list, tuple)):
        items = list(value)
        if not items:
            raise ValueError(f"{name} must not be an empty list")
        return items
    if value is None:
        raise ValueError(f"{name} is required")
    return [value]


async def _sender_state(sender) -> SenderState:
    if isinstance(sender, SenderState):
        return sender
    # A bound agent prepares its state in a worker through `_rclc_sender_state`.
    provider = getattr(sender, "_rclc_sender_state", None) or getattr(sender, "sender_state", None)
    if provider is None:
        raise TypeError(f"a sender must be a SenderState or provide sender_state(), got {type(sender).__name__}")
    state = provider()
    if inspect.isawaitable(state):
        state = await state
    if not isinstance(state, SenderState):
        raise TypeError(f"{type(sender).__name__}.sender_state() returned {type(state).__name__}, not a SenderState")
    return state


def _request_ids(state: SenderState, request) -> torch.Tensor:
    if isinstance(request, str):
        if state.tokenizer is None:
            raise ValueError("a string request needs each sender's tokenizer; this sender has none (pass int64 IDs)")
        if not request:
            raise ValueError("the request must not be empty")
        ids = hf.encode_text(state.tokenizer, request, hf.text_limit(state.model), what="the request")
        return hf.check_ids(ids, hf.vocab_size(state.model), "request IDs")
    if isinstance(request, torch.Tensor):
        return hf.check_ids(request, hf.vocab_size(state.model), "request IDs")
    raise TypeError(f"a request must be a string or int64 [1, tokens] IDs, got {type(request).__name__}")


async def transfer(
    sender,
    receiver,
    request,
    *,
    ratio: int | None = None,
    budget: int | None = None,
    representation: str = "embeddings",
    selector=None,
    reasoning=None,
    reasoning_context: str | None = None,
    reasoning_budget: int | None = None,
    record_selection: bool = False,
) -> None:
    """Hand selected sender rows to receivers; returns None once every receiver has been called.

    Args:
        sender: a SenderState (or an object with ``sender_state()``), or a list of them.
        receiver: a `RowReceiver` (an HFReceiver or a bound Agent), a callable taking a Delivery
            (sync or async), or a list.
        request: a string or a nonempty int64 [1, tokens] tensor, or a list; each request goes
            to every receiver.
        ratio / budget: relative (r4 when neither is given) or bounded position budget per sender.
        representation: "embeddings" or "token_ids+continuous".
        selector: ``selector(sender, request_ids, budget) -> positions``; default CacheBack.
        reasoning: a method appending continuous rows (e.g. ``partial(latent_mass, steps=40)``).
        reasoning_context: "full" (default), "full_with_request", "selected", "selected_with_request".
        reasoning_budget: most rows reasoning may add (required after selection).
        record_selection: attach a SelectionRecord to every message.

    Raises:
        ValueError / TypeError: invalid options or inputs, checkpoint mismatches, impossible
        budgets, invalid selector or reasoning results (nothing is delivered).
    """
    mode = budget_rules.resolve_mode(ratio, budget)
    if representation not in REPRESENTATIONS:
        raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {representation!r}")
    selector = DEFAULT_SELECTOR if selector is None else selector
    if not callable(selector):
        hint = f": the built-in ones are rclc.selectors.{', '.join(BY_NAME)}" if isinstance(selector, str) else ""
        raise TypeError(f"selector must be callable (selector(sender, request_ids, budget) -> positions), got "
                        f"{selector!r}{hint}")
    post_selection = _check_reasoning(reasoning, reasoning_context, reasoning_budget)
    context = reasoning_context or "full"

    senders = _items(sender, "sender")
    receivers = _items(receiver, "receiver")
    requests = _items(request, "request")
    for r in receivers:
        if not (isinstance(r, RowReceiver) or callable(r)):
            raise TypeError(f"a receiver must be an HFReceiver, a bound Agent (a RowReceiver) or a callable, got {type(r).__name__}")
    states = [await _sender_state(s) for s in senders]
    for state in states:
        state.validate()
    request_ids = [[_request_ids(state, q) for state in states] for q in requests]

    # Receivers: checkpoint checks and prompt snapshots before any model work.
    row_receivers: dict[int, RowReceiver] = {i: r for i, r in enumerate(receivers) if isinstance(r, RowReceiver)}
    plans: dict[int, list[ReceiverPlan]] = {}
    for i, r in row_receivers.items():
        check = getattr(r, "_rclc_check_sender", None)
        if check is not None:
            for state in states:
                check(state)
        plans[i] = [r._rclc_plan(q) for q in requests]
    spaces = [budget_rules.tightest(plans[i][qi].space for i in plans) for qi in range(len(requests))]

    # Reasoning before selection.
    routes: list[list[_Route]] = []
    if reasoning is not None and context == "full":
        extended = [
            await run_method(reasoning, s, _reasoning_room(s, reasoning_budget, 0), None) for s in states
        ]
    else:
        extended = states
    for qi in range(len(requests)):
        row = []
        for si, state in enumerate(extended):
            ids = request_ids[qi][si]
            if reasoning is not None and context == "full_with_request":
                room = _reasoning_room(state, reasoning_budget, ids.shape[1])
                state = await run_method(reasoning, state, room, ids)
            row.append(_Route(state=state, request_ids=ids))
        routes.append(row)

    # Plan every request's budgets before any selection, then select and build messages.
    for qi, row in enumerate(routes):
        _plan_budgets(row, spaces[qi], mode, selector, reasoning_budget if post_selection else 0, qi)
    for row in routes:
        for route in row:
            await _prepare_message(route, selector, representation, reasoning if post_selection else None,
                                   context, reasoning_budget, record_selection)

    deliveries = [Delivery(request=q, messages=tuple(route.message for route in row)) for q, row in zip(requests, routes)]

    # Deliver: request order, then receiver order.
    for qi, delivery in enumerate(deliveries):
        for i, r in enumerate(receivers):
            if i in row_receivers:
                row_receivers[i]._rclc_accept(delivery, plans[i][qi])
                continue
            result = r(delivery)
            if inspect.isawaitable(result):
                await result


def transfer_sync(*args: Any, **kwargs: Any) -> None:
    """`transfer` for synchronous code (same arguments); needs a thread without a running event loop."""
    require_no_running_loop("transfer_sync")
    asyncio.run(transfer(*args, **kwargs))


def _plan_budgets(row: list[_Route], space: int | None, mode, selector, reserved: int, request_index: int) -> None:
    """Set each route's fitted message budget for one request (all senders share ``space``)."""
    demands = []
    for si, route in enumerate(row):
        st = route.state
        limit = hf.context_limit(st.model)
        if st.positions + route.request_ids.shape[1] > limit:
            raise ValueError(
                f"sender {si} has {st.positions} positions; with the {route.request_ids.shape[1]}-token "
                f"request it exceeds its context limit of {limit}"
            )
        if reserved:
            maximum, _ = budget_rules.split_post_selection(st.positions, st.inherited_positions, mode, reserved)
        else:
            maximum = mode.positions(st.positions, st.inherited_positions)
        protected = selector.protected_count(st.positions, st.latent_steps) if is_builtin(selector) else 1
        demands.append(budget_rules.Demand(maximum=maximum, protected=protected, reserved=reserved))
    try:
        fitted = budget_rules.fit_budgets(demands, space)
    except ValueError as e:
        raise ValueError(f"request {request_index}: {e}") from None
    for route, b in zip(row, fitted):
        route.budget = b


async def _prepare_message(route: _Route, selector, representation: str, post_reasoning, context: str,
                           reasoning_budget: int | None, record: bool) -> None:
    """Select, reason after selection when asked, and build the route's message."""
    reserved = reasoning_budget if post_reasoning is not None else 0
    route.positions = await run_in_worker(_select, selector, route.state, route.request_ids, route.budget - reserved)
    payload, positions, added = route.state, route.positions, 0
    if post_reasoning is not None:
        selected = await run_in_worker(_selected_state, route.state, route.positions)
        with_request = route.request_ids if context == "selected_with_request" else None
        payload = await run_method(post_reasoning, selected, reasoning_budget, with_request)
        added = payload.positions - selected.positions
        positions = torch.arange(payload.positions)
    message = await run_in_worker(_build_message, payload, positions, representation)
    if record:
        message.selection = build_record(route.state, route.positions, route.budget, added, message.positions)
    route.message = message


def _check_reasoning(reasoning, context, reasoning_budget) -> bool:
    """Validate the reasoning options; True when reasoning runs after selection."""
    if reasoning is None:
        if context is not None or reasoning_budget is not None:
            raise ValueError("reasoning_context and reasoning_budget require reasoning=...")
        return False
    if not callable(reasoning):
        raise TypeError("reasoning must be callable: method(state, *, max_positions, request=None) -> SenderState")
    if context is not None and context not in REASONING_CONTEXTS:
        raise ValueError(f"reasoning_context must be one of {REASONING_CONTEXTS}, got {context!r}")
    if reasoning_budget is not None:
        positive_int("reasoning_budget", reasoning_budget)
    post = context in ("selected", "selected_with_request")
    if post and reasoning_budget is None:
        raise ValueError(f"reasoning_context={context!r} runs after selection and requires reasoning_budget=N")
    return post


def _reasoning_room(state: SenderState, reasoning_budget: int | None, request_tokens: int) -> int:
    """Rows reasoning may add before selection: the reasoning budget, else the sender's free context."""
    free = max(0, hf.context_limit(state.model) - state.positions - request_tokens)
    return free if reasoning_budget is None else min(reasoning_budget, free)


def _select(selector, state: SenderState, request_ids: torch.Tensor, budget: int) -> torch.Tensor:
    return validate_positions(selector(state, request_ids, budget), state.positions, budget)


def _selected_state(state: SenderState, positions: torch.Tensor) -> SenderState:
    """A fresh state holding only the selected rows (prefilled on a new cache)."""
    if positions.numel() == 0:
        raise ValueError("reasoning after selection needs at least one selected row; the selector returned none")
    index = positions.to(state.input_embeds.device)
    rows = state.input_embeds[index]
    latent_start = state.positions - state.latent_steps
    return SenderState(
        model=state.model,
        past_key_values=hf.prefill(state.model, rows),
        input_embeds=rows,
        tokenizer=state.tokenizer,
        latent_steps=int((positions >= latent_start).sum()),
        token_ids=None if state.token_ids is None else state.token_ids[positions.to(state.token_ids.device)],
        inherited_positions=int((positions < state.inherited_positions).sum()),
    )


def _build_message(state: SenderState, positions: torch.Tensor, representation: str) -> Message:
    """The payload for ``positions`` (int64 [k]) of ``state``; rows are copies, never views."""
    index = positions.to(state.input_embeds.device)
    rows = state.input_embeds[index].clone()
    source = hf.identity(state.model)
    if representation == "embeddings":
        return Message(rows=rows, representation=representation, source=source)
    if state.token_ids is None:
        ids = torch.full((rows.shape[0],), -1, dtype=torch.long)
    else:
        ids = state.token_ids[positions.to(state.token_ids.device)].detach().cpu().clone()
    weight = hf.embedding_weight(state.model)
    # Compared with the table lookup that `Message.materialize` uses to rebuild the rows.
    if not rows_match_ids(rows, ids, lambda known: weight[known.to(weight.device)]):
        raise ValueError(
            "the selected token IDs do not reproduce the sender's input rows (embedding table "
            "lookups differ); use representation='embeddings'"
        )
    known = ids >= 0
    return Message(rows=rows[(~known).to(rows.device)].clone(), token_ids=ids, representation=representation, source=source)

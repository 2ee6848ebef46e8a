"""`HFReceiver`: an inbox of deliveries that turns each into ``model.generate`` inputs.

Placement of the received rows:

- ``"prefix"`` (default): rows first, then the freshly rendered prompt (history + request +
  assistant prefix, thinking disabled). A fresh prefill; no receiver cache is spliced.
- ``"in_prompt"``: rows at a marked slot inside the user turn. The user turn is
  ``slot_template`` with ``{context}`` replaced by the rows and ``{request}`` by the request,
  so the rows sit where the context text of a plain text handoff would sit. Small models such as
  SmolLM2-135M do not read rows placed before a fresh chat prompt but do read them here.
  The text on each side of the slot is tokenized on its own: with newlines around the slot
  (``"Context:\n{context}\n..."``) byte-level BPE tokenizers give exactly the cold read's tokens
  at r1; ``"Context: {context}"`` differs from it by the split of the space before the context.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ilcp.checks import positive_int, text_input
from ilcp.rclc import budget as budget_rules
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK
from ilcp.rclc.message import Delivery

PLACEMENTS = ("prefix", "in_prompt")
DEFAULT_SLOT_TEMPLATE = "Context: {context}\nQuestion: {request}"
_SLOT = "\u2063rclc-context-slot\u2063"
_REQUEST = "\u2063rclc-request-slot\u2063"  # stands for every request in `HFReceiver.request_stem`


@dataclass(frozen=True)
class RenderedPrompt:
    """A receiver prompt split around the received rows.

    Attributes:
        before: int64 [1, a] tokens before the rows (empty for "prefix" placement).
        after: int64 [1, b] tokens after the rows.
    """

    before: torch.Tensor
    after: torch.Tensor

    @property
    def positions(self) -> int:
        return int(self.before.shape[1] + self.after.shape[1])


@dataclass(frozen=True)
class ReceiverPlan:
    """A receiver's snapshot for one request: its rendered prompt and the space left for rows.

    Attributes:
        prompt: the prompt rendered against the history as it was when the request was planned.
        space: positions the receiver can hold for received rows (context limit - prompt -
            output allowance); may be negative, which makes the transfer fail before selection.
    """

    prompt: RenderedPrompt
    space: int


@runtime_checkable
class RowReceiver(Protocol):
    """A receiver that takes part in budget fitting (`HFReceiver` and `Agent` are ones).

    `transfer` treats every receiver that has both methods as a RowReceiver (any other receiver
    must be a callable taking a `Delivery`). For one call it:

    1. calls ``_rclc_check_sender(state)`` for every sender's `SenderState`, when the receiver
       defines it (optional; it raises ValueError for a sender it cannot read, e.g. another
       checkpoint), before any model work;
    2. calls `_rclc_plan` once per request, before any model work;
    3. after every message is built, calls `_rclc_accept` once per request, in request order
       and then receiver-list order, with the plan `_rclc_plan` returned for that request.

    An exception from the first two steps delivers nothing; one from `_rclc_accept` propagates
    at once and leaves earlier deliveries in place.
    """

    def _rclc_plan(self, request: str | torch.Tensor) -> ReceiverPlan:
        """Snapshot what the receiver will put around the rows for ``request``.

        Args:
            request: the request as passed to `transfer` (a string or int64 [1, tokens] IDs).
        Returns:
            a `ReceiverPlan`; `transfer` reads its ``space`` and fits every sender's budget to
            the tightest receiver of the request.
        Raises:
            ValueError / TypeError: a request this receiver cannot render.
        """
        ...

    def _rclc_accept(self, delivery: Delivery, plan: ReceiverPlan) -> None:
        """Take ``delivery`` (the request and one selected `Message` per sender) with its ``plan``."""
        ...


@dataclass(frozen=True)
class InputLayout:
    """Where the received rows sit in prepared inputs.

    Attributes:
        token_ids: int64 [P] aligned with the input rows: prompt token IDs, the received
            positions' IDs where the delivery carried them, -1 for received continuous rows.
        received_start / received_stop: the received rows are ``[received_start, received_stop)``.
    """

    token_ids: torch.Tensor
    received_start: int
    received_stop: int


def received_token_ids(delivery: Delivery) -> torch.Tensor:
    """int64 [positions] of a delivery in sender order: known IDs of mixed messages, else -1."""
    parts = []
    for m in delivery.messages:
        if m.token_ids is not None:
            parts.append(m.token_ids.detach().cpu().to(torch.long))
        else:
            parts.append(torch.full((m.positions,), -1, dtype=torch.long))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class _Queued:
    delivery: Delivery
    prompt: RenderedPrompt
    kept: tuple | None = None  # (key, value) of `HFReceiver.kept_for`, dropped with the entry


class HFReceiver:
    """A Hugging Face receiver: call it with a Delivery (or pass it to transfer), then pop().

    Args:
        model: the receiving causal LM (the sender's checkpoint).
        tokenizer: its tokenizer (needed for string requests).
        messages: chat history (system instructions and prior turns, not the request). Read at
            each transfer, never modified.
        max_new_tokens: output allowance passed to generate; unset reserves one position.
        context_limit: at most the model's ``max_position_embeddings`` (the default).
        placement: "prefix" or "in_prompt" (see the module docstring).
        slot_template: user-turn text for "in_prompt", with one ``{context}`` and one ``{request}``.

    Raises:
        ValueError: a context limit above the model's, a bad placement or slot template.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        messages=None,
        *,
        max_new_tokens: int | None = None,
        context_limit: int | None = None,
        placement: str = "prefix",
        slot_template: str = DEFAULT_SLOT_TEMPLATE,
    ) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
            raise TypeError(f"model must be a Hugging Face model, got {type(model).__name__}")
        model_limit = hf.context_limit(model)
        if context_limit is None:
            context_limit = model_limit
        positive_int("context_limit", context_limit)
        if context_limit > model_limit:
            raise ValueError(f"context_limit={context_limit} exceeds the model's {model_limit} positions")
        if max_new_tokens is not None:
            positive_int("max_new_tokens", max_new_tokens)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if not isinstance(slot_template, str) or slot_template.count("{context}") != 1 or slot_template.count("{request}") != 1:
            raise ValueError("slot_template must contain '{context}' and '{request}' exactly once each")
        if messages is not None:
            hf._check_messages(messages, hf.text_limit(model))
        self.model = model
        self.tokenizer = tokenizer
        self.messages = messages
        self.max_new_tokens = max_new_tokens
        self.context_limit = context_limit
        self.placement = placement
        self.slot_template = slot_template
        self._queue: collections.deque[_Queued] = collections.deque()

    # ---------------------------------------------------------------------------------------
    # rendering

    @property
    def output_allowance(self) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else 1

    def render(self, request) -> RenderedPrompt:
        """The prompt for ``request`` after the current history, split around the rows.

        Raises:
            ValueError: a tensor request with chat history or with "in_prompt" placement, a
            string request without a tokenizer, IDs outside the vocabulary.
        """
        if isinstance(request, torch.Tensor):
            if self.messages:
                raise ValueError("a token-ID request cannot follow chat history: its framing is unknown; pass a string")
            if self.placement == "in_prompt":
                raise ValueError("in_prompt placement renders the request into a slot; pass a string request")
            return RenderedPrompt(torch.zeros(1, 0, dtype=torch.long),
                                  hf.check_ids(request, hf.vocab_size(self.model), "request IDs"))
        if not isinstance(request, str):
            raise TypeError(f"a request must be a string or int64 [1, tokens] IDs, got {type(request).__name__}")
        if self.tokenizer is None:
            raise ValueError("a string request needs the receiver's tokenizer")
        text_input("the request", request, hf.text_limit(self.model))  # before the template renders it
        before, after = self._prompt_text(request)
        return RenderedPrompt(self._encode(before), self._encode(after))

    def _prompt_text(self, request: str) -> tuple[str, str]:
        """The rendered prompt text for a string request, split at the rows (``before`` is empty
        for "prefix" placement)."""
        if self.tokenizer is None:
            raise ValueError("a string request needs the receiver's tokenizer")
        history = list(self.messages or [])
        content = request
        if self.placement == "in_prompt":
            content = self.slot_template.replace("{request}", request).replace("{context}", _SLOT)
        if getattr(self.tokenizer, "chat_template", None):
            text = hf.render_chat(self.tokenizer, history + [{"role": "user", "content": content}],
                                  add_generation_prompt=True, max_tokens=hf.text_limit(self.model))
        elif history:
            raise ValueError("chat history needs a tokenizer with a chat template")
        else:
            text = content
        if self.placement == "prefix":
            return "", text
        if text.count(_SLOT) != 1:
            raise ValueError("the chat template did not keep the context slot intact")
        before, after = text.split(_SLOT)
        return before, after

    def _encode(self, text: str) -> torch.Tensor:
        if not text:
            return torch.zeros(1, 0, dtype=torch.long)
        return hf.encode_text(self.tokenizer, text, hf.text_limit(self.model), what="the receiver's prompt")

    def request_stem(self) -> RenderedPrompt | None:
        """What the prompt of every string request shares around the rows, against the current
        history: ``before`` the rows as rendered, and ``after`` them the IDs of the text before
        the request less the last one (which a request's first characters could merge with).

        None where the request stands before the rows (an "in_prompt" slot template that puts
        ``{request}`` before ``{context}``): then no part holding the rows is shared.

        Raises:
            ValueError: no tokenizer, or a history the template cannot render.
        """
        before, after = self._prompt_text(_REQUEST)
        if _REQUEST in before or after.count(_REQUEST) != 1:
            return None
        head = self._encode(after.split(_REQUEST)[0])
        return RenderedPrompt(self._encode(before), head[:, :max(int(head.shape[1]) - 1, 0)])

    def handoff_space(self, request, max_new_tokens: int | None = None) -> int:
        """Positions left for received rows: context limit - rendered prompt - output allowance."""
        allowance = self.output_allowance if max_new_tokens is None else positive_int("max_new_tokens", max_new_tokens)
        return budget_rules.handoff_space(self.context_limit, self.render(request).positions, allowance)

    # ---------------------------------------------------------------------------------------
    # the transfer protocol (`RowReceiver`)

    def _rclc_check_sender(self, state) -> None:
        """Reject a sender of another architecture, checkpoint or vocabulary (ValueError)."""
        hf.check_same_checkpoint(state.model, state.tokenizer, self.model, self.tokenizer)

    def _rclc_plan(self, request) -> ReceiverPlan:
        """The prompt snapshot for ``request`` and the space it leaves (see `RowReceiver`)."""
        prompt = self.render(request)
        space = budget_rules.handoff_space(self.context_limit, prompt.positions, self.output_allowance)
        return ReceiverPlan(prompt=prompt, space=space)

    def _rclc_accept(self, delivery: Delivery, plan: ReceiverPlan) -> None:
        """Queue ``delivery`` with the prompt snapshot taken when it was planned."""
        self._queue.append(_Queued(delivery, plan.prompt))

    def __call__(self, delivery: Delivery) -> None:
        """Queue a delivery, rendering its prompt against the history as it is now."""
        if not isinstance(delivery, Delivery):
            raise TypeError(f"expected a Delivery, got {type(delivery).__name__}")
        self._queue.append(_Queued(delivery, self.render(delivery.request)))

    # ---------------------------------------------------------------------------------------
    # the inbox

    def __len__(self) -> int:
        return len(self._queue)

    def queued(self) -> list[tuple[Delivery, RenderedPrompt]]:
        """Each queued delivery with its prompt snapshot, in queue order (nothing is consumed)."""
        return [(entry.delivery, entry.prompt) for entry in self._queue]

    def consume_next(self) -> None:
        """Drop the next queued delivery (after `prepare_next` produced its inputs)."""
        if not self._queue:
            raise IndexError("the receiver has no queued handoff")
        self._queue.popleft()

    def peek(self) -> Delivery:
        """The next delivery, without consuming it."""
        if not self._queue:
            raise IndexError("the receiver has no queued handoff")
        return self._queue[0].delivery

    def kept_for(self, delivery: Delivery, key, build):
        """``build()``'s value for ``key``, kept with the queued ``delivery`` until it is consumed:
        built again only for another key (`Agent.ask` keeps the shared part's cache here). A
        delivery no longer queued gets ``build()``'s value, not kept."""
        queued = tuple(self._queue)  # a copy: a transfer may queue another handoff meanwhile
        entry = next((e for e in queued if e.delivery is delivery), None)
        if entry is None:
            return build()
        if entry.kept is None or entry.kept[0] != key:
            entry.kept = (key, build())
        return entry.kept[1]

    def pop(self, prompt=None, max_new_tokens: int | None = None) -> dict:
        """Generate inputs for the next delivery, consuming it only when they are ready.

        Args:
            prompt: replaces the queued request (a string, rendered with the current history, or
                int64 [1, tokens] IDs); selection is not rerun.
            max_new_tokens: replaces the output allowance.
        Returns:
            ``{"inputs_embeds": [1, P, hidden], "attention_mask": int64 [1, P], "max_new_tokens": n}``
            for ``model.generate(**inputs)``.
        Raises:
            IndexError: nothing is queued.
            ValueError: rows, prompt and allowance exceed the context limit (the delivery stays queued).
        """
        inputs, _ = self.prepare_next(prompt, max_new_tokens)
        self.consume_next()
        return inputs

    def prepare_next(self, prompt=None, max_new_tokens: int | None = None) -> tuple[dict, "InputLayout"]:
        """`pop`'s inputs for the next delivery and their layout, without consuming it."""
        if not self._queue:
            raise IndexError("the receiver has no queued handoff")
        entry = self._queue[0]
        rendered = entry.prompt if prompt is None else self.render(prompt)
        allowance = self.output_allowance if max_new_tokens is None else positive_int("max_new_tokens", max_new_tokens)
        weight = hf.embedding_weight(self.model)
        with MODEL_LOCK:
            rows = entry.delivery.rows(weight)
            needed = rows.shape[0] + rendered.positions + allowance
            if needed > self.context_limit:
                raise ValueError(
                    f"{rows.shape[0]} received rows + {rendered.positions} prompt positions + {allowance} "
                    f"output positions exceed the context limit of {self.context_limit}"
                )
            parts = [
                hf.embed_ids(self.model, rendered.before[0]),
                rows,
                hf.embed_ids(self.model, rendered.after[0]),
            ]
            embeds = torch.cat(parts, dim=0).unsqueeze(0)
        inputs = {
            "inputs_embeds": embeds,
            "attention_mask": torch.ones(1, embeds.shape[1], dtype=torch.long, device=embeds.device),
            "max_new_tokens": allowance,
        }
        token_ids = torch.cat([rendered.before[0], received_token_ids(entry.delivery), rendered.after[0]])
        start = int(rendered.before.shape[1])
        return inputs, InputLayout(token_ids=token_ids, received_start=start, received_stop=start + int(rows.shape[0]))

    def __repr__(self) -> str:
        return (
            f"HFReceiver(model={type(self.model).__name__}, queued={len(self)}, placement={self.placement!r}, "
            f"context_limit={self.context_limit}, max_new_tokens={self.max_new_tokens})"
        )

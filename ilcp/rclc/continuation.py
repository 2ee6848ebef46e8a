"""An agent's continuations: `Agent.pop` and `Agent.inputs` hand out generation inputs, recorded as
`PendingInputs`, and `Agent.update` records new sender state, the continuation of those inputs
among its forms.

`Continuations` is a base class of `ilcp.rclc.agent.Agent`: its methods use the agent's guards,
backend, receiver inbox and sender state. While inputs are pending the agent refuses to send,
pop, prepare, append, save or load; every method validates and computes first and changes the
agent last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp.checks import positive_int
from ilcp.rclc.runtime import MODEL_LOCK, run_in_worker

__all__ = ["Continuations", "PendingInputs"]


@dataclass(frozen=True)
class PendingInputs:
    """Inputs handed out by `Agent.pop` or `Agent.inputs`, awaiting ``update(inputs=..., generation=...)``.

    Attributes:
        inputs: the exact dictionary returned (identity is checked).
        embeds: its row tensor as returned: ``inputs_embeds`` [1, P, hidden] (HF) or
            ``prompts["prompt_embeds"]`` [P, hidden] (vLLM).
        token_ids: int64 [P] aligned IDs, -1 for continuous rows.
        inherited_positions: leading rows that count as inherited after the update.
        source: "pop" or "inputs".
    """

    inputs: dict
    embeds: torch.Tensor
    token_ids: torch.Tensor
    inherited_positions: int
    source: str

    @property
    def rows(self) -> torch.Tensor:
        """The input rows [P, hidden]."""
        return self.embeds[0] if self.embeds.dim() == 3 else self.embeds

    @property
    def positions(self) -> int:
        """P, the number of input rows."""
        return int(self.rows.shape[0])


class Continuations:
    """`Agent`'s ``pop``, ``inputs`` and ``update`` (see the module docstring)."""

    def pop(self, prompt=None, max_new_tokens: int | None = None, *, discard_pending: bool = False) -> dict:
        """Generation inputs for the next queued handoff; consumes it and records the inputs as pending.

        Args:
            prompt: replaces the queued request (string or int64 [1, tokens] IDs), no reselection.
            max_new_tokens: replaces the output allowance.
            discard_pending: replace inputs still pending from an earlier pop() or inputs()
                (for answers that will not be sent onward).
        Returns:
            ``{"inputs_embeds": [1, P, hidden], "attention_mask": int64 [1, P], "max_new_tokens": n}``
            (vLLM: ``{"prompts": {"prompt_embeds": [P, hidden]}, "sampling_params": ..., "use_tqdm": False}``).
        Raises:
            RuntimeError: inputs are pending and ``discard_pending`` is False.
            IndexError: nothing is queued.
            ValueError: rows, prompt and allowance exceed the context limit (the handoff stays queued).
        """
        self._check_idle("pop()")
        if not discard_pending:
            self._check_no_pending("pop another handoff")
        prepared, layout = self._receiver.prepare_next(prompt, max_new_tokens)
        inputs = self._backend.receiver_inputs(prepared)
        pending = PendingInputs(inputs=inputs, embeds=self._backend.input_rows(inputs), token_ids=layout.token_ids,
                                inherited_positions=layout.received_stop, source="pop")
        self._receiver.consume_next()
        self._pending = pending
        return inputs

    async def inputs(self, max_new_tokens: int | None = None) -> dict:
        """Generation inputs for the retained state, recorded as pending (no queued handoff is consumed).

        The retained rows are passed whole as ``inputs_embeds``. On HF, when the agent already
        holds their cache (an explicit state, or the prefilled history), a copy of it comes along
        (``past_key_values``, or ``cache`` where transformers names it so), so generation
        prefills only the last row; otherwise generation prefills them once.

        Returns:
            ``{"inputs_embeds": [1, T, hidden], "attention_mask": int64 [1, T], "max_new_tokens": n}``
            (vLLM: ``{"prompts": {"prompt_embeds": [T, hidden]}, "sampling_params": ..., "use_tqdm": False}``).
        Raises:
            RuntimeError: inputs are pending, or another operation is in progress.
            ValueError: no state, or no room for ``max_new_tokens`` within the context limit.
        """
        self._check_idle("inputs()")
        self._check_no_pending("prepare inputs")
        allowance = self.max_new_tokens if max_new_tokens is None else positive_int("max_new_tokens", max_new_tokens)
        with self._running("inputs()"):
            rows, ids, inherited, _ = await run_in_worker(self._current_rows, lock=False)
            if rows.shape[0] + allowance > self.context_limit:
                raise ValueError(
                    f"{rows.shape[0]} retained positions + {allowance} output positions exceed the "
                    f"context limit of {self.context_limit}"
                )
            with MODEL_LOCK:
                inputs = self._backend.generation_inputs(rows, allowance, cache=self._current_cache(rows))
        self._pending = PendingInputs(inputs=inputs, embeds=self._backend.input_rows(inputs), token_ids=ids.clone(),
                                      inherited_positions=inherited, source="inputs")
        return inputs

    def update(self, source=None, *, inputs: dict | None = None, generation=None, past_key_values=None,
               request_id: str | None = None) -> None:
        """Record new sender state.

        Forms:
            ``update(inputs=inputs, generation=output)``: the continuation of the latest pop() or
                inputs(); ``inputs`` must be that exact dictionary, generated from without adding
                input_ids. Keeps the exact input rows, appends the new tokens and completes the
                uncached suffix on a private copy of the generation's cache. Received continuous
                rows keep token ID -1 and count as inherited positions.
            ``update(generation=output)``: an ordinary token-input generation.
            ``update(exact_ids, past_key_values=cache)``: a current prompt and its (prefix) cache;
                ``exact_ids`` may also be rendered text or chat messages.
            ``update(exact_ids, request_id=capture_id)`` (vLLM): a prompt registered with
                `request_capture`, re-prefilled through the shared-weight view.
            vLLM generations are ``llm.generate``'s output (a one-element list of RequestOutput).
            ``update()``: discard explicit state and pending inputs; send the message history again.

        Raises:
            RuntimeError: no pending inputs for ``inputs=``, or another operation is in progress.
            ValueError / TypeError: a different dictionary, added input_ids, replaced rows, an
            invalid generation, a state beyond the context limit. The previous state, pending
            inputs and queue are kept.
        """
        self._check_idle("update()")
        if inputs is not None:
            if generation is None:
                raise ValueError("update(inputs=...) needs generation=<the model.generate output>")
            if source is not None or past_key_values is not None or request_id is not None:
                raise ValueError("update(inputs=..., generation=...) takes no prompt, past_key_values or request_id")
            pending = self._pending
            if pending is None:
                raise RuntimeError("no pending inputs: call pop() or await inputs() first")
            if inputs is not pending.inputs:
                raise ValueError("pass the exact dictionary returned by the latest pop() or inputs()")
            if "input_ids" in inputs:
                raise ValueError("generate from the continuous inputs without adding input_ids")
            if self._backend.input_rows(inputs) is not pending.embeds:
                raise ValueError("the input rows were replaced; pass the dictionary as it was returned")
            self._backend.check_generation_inputs(inputs, pending.positions)
            with MODEL_LOCK:
                state = self._backend.continuation_state(pending.rows, pending.token_ids, pending.inherited_positions,
                                                         generation)
        elif generation is not None:
            if source is not None or past_key_values is not None or request_id is not None:
                raise ValueError("pass generation=... alone, or exact IDs with an optional past_key_values")
            with MODEL_LOCK:
                state = self._backend.generation_state(generation)
        elif source is not None:
            with MODEL_LOCK:
                state = self._backend.source_state(source, past_key_values, request_id)
        elif past_key_values is not None:
            raise ValueError("past_key_values needs the exact IDs it was built from: update(exact_ids, past_key_values=cache)")
        elif request_id is not None:
            raise ValueError("request_id needs the exact captured prompt: update(exact_ids, request_id=capture_id)")
        else:
            self._explicit = None
            self._pending = None
            return
        self._check_fits(state.positions)
        self._explicit = state
        self._pending = None

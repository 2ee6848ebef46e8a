"""`Agent` (alias `bind`): an existing agent's model, history and state, bound for RCLC.

    agent_x = rclc.bind(model, tokenizer, messages=history_x, backend="hf")
    agent_y = rclc.bind(model, tokenizer, messages=history_y, backend="hf")
    await rclc.transfer(agent_x, agent_y, question)
    inputs = agent_y.pop()
    output = model.generate(**inputs, return_dict_in_generate=True)
    agent_y.update(inputs=inputs, generation=output)
    await rclc.transfer(agent_y, agent_x, follow_up)

On vLLM (``ilcp.rclc.vllm``): ``rclc.bind(llm, backend="vllm", messages=history)``; pop() and
inputs() then return ``llm.generate(**inputs)`` arguments and update takes its output.

An agent is a sender when it stands first in `transfer` and a receiver when it stands second.

State, as a sender: either the *history* (the bound ``messages``, rendered without a new
assistant prefix and prefilled lazily; a later send reuses that prefill and extends it by an
appended suffix, while an edited earlier token causes a fresh prefill) or an *explicit* state
(from ``prompt=``/``generation=`` at bind, `update`, `append` or `load`), which stays current
until append or update changes it. ``update()`` with no arguments returns to the history.

Continuations: `pop` (a received handoff) and `inputs` (the retained state) return
``model.generate`` inputs and record them as *pending*; `update(inputs=..., generation=...)`
records the continuation. While inputs are pending the agent refuses to send, pop, prepare,
append, save or load, so it never sends stale state. `ask` (``ilcp.rclc.questions``) answers
several questions over one queued handoff, prefilling the part they share once, and changes
nothing. Every operation validates and computes
first and changes the agent last: a failed or cancelled call keeps the previous state,
pending inputs and queue. The bound ``messages`` list is never modified.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from ilcp.checks import check_key, positive_int
from ilcp.rclc import snapshot as snapshots
from ilcp.rclc.runtime import MODEL_LOCK, run_in_worker
from ilcp.rclc.backends import resolve_backend
from ilcp.rclc.continuation import Continuations, PendingInputs
from ilcp.rclc.message import Delivery
from ilcp.rclc.questions import Questions
from ilcp.rclc.receiver import DEFAULT_SLOT_TEMPLATE, ReceiverPlan, RenderedPrompt
from ilcp.rclc.report import agent_report
from ilcp.rclc.state import SenderState, rows_match_ids


class Agent(Continuations, Questions):
    """A bound agent: sender and receiver state over an existing model (see the module docstring).

    Args:
        model: the loaded model: backend="hf", a Hugging Face causal LM in eval mode;
            backend="vllm", an in-process ``vllm.LLM`` (see `ilcp.rclc.vllm`).
        tokenizer: its tokenizer (needed for messages, text and snapshots; vLLM: the engine's by default).
        messages: chat history (system instructions and prior turns). It is the receiver
            history, and the sender state when no explicit state is given. Read, never modified.
        prompt: explicit sender state: chat messages, rendered text or int64 [1, tokens] IDs.
        past_key_values: a cache for a prefix of ``prompt`` (reused or extended, never modified; HF only).
        request_id: with backend="vllm" and ``prompt`` as exact IDs, a `request_capture` ID to consume.
        generation: explicit sender state from a token-input ``generate(...,
            return_dict_in_generate=True)`` output.
        backend: "hf" or "vllm" (BackendUnavailableError where vLLM is missing, or for an engine
            created with the capture connector this build does not have).
        max_new_tokens: output reservation for generation inputs and receiver budget fitting.
        context_limit: at most the model's (the default).
        placement / slot_template: where received rows go (see `HFReceiver`). With "in_prompt"
            the inherited prefix after an update runs through the last received row.
        allow_unstable: opt-in for unstable vLLM releases (recorded; checked by `rclc.check`).

    Raises:
        ValueError / TypeError: conflicting sources, a model in training mode, a context limit
        above the model's, explicit state longer than the context limit.
        BackendUnavailableError: backend="vllm" without vLLM, or an engine this build cannot serve.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        messages=None,
        prompt=None,
        past_key_values=None,
        generation=None,
        request_id: str | None = None,
        backend: str = "hf",
        max_new_tokens: int = 128,
        context_limit: int | None = None,
        placement: str = "prefix",
        slot_template: str = DEFAULT_SLOT_TEMPLATE,
        allow_unstable: bool = False,
    ) -> None:
        self._backend = resolve_backend(backend, model, tokenizer, allow_unstable=allow_unstable)
        self.allow_unstable = allow_unstable
        if prompt is not None and generation is not None:
            raise ValueError("bind with prompt=... or generation=..., not both")
        if past_key_values is not None and prompt is None:
            raise ValueError("past_key_values needs the exact prompt it was built from: bind(..., prompt=ids, past_key_values=cache)")
        if request_id is not None and prompt is None:
            raise ValueError("request_id needs the exact captured prompt: bind(llm, backend='vllm', prompt=ids, request_id=...)")
        positive_int("max_new_tokens", max_new_tokens)
        self._receiver = self._backend.receiver(messages, max_new_tokens=max_new_tokens, context_limit=context_limit,
                                                placement=placement, slot_template=slot_template)
        explicit = None
        if prompt is not None:
            with MODEL_LOCK:
                explicit = self._backend.source_state(prompt, past_key_values, request_id)
        elif generation is not None:
            with MODEL_LOCK:
                explicit = self._backend.generation_state(generation)
        if explicit is not None:
            self._check_fits(explicit.positions)
        self._explicit: SenderState | None = explicit
        self._history: tuple[torch.Tensor, SenderState] | None = None
        self._pending: PendingInputs | None = None
        self._busy: str | None = None

    # ---------------------------------------------------------------------------------------
    # configuration

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def model(self):
        """The HF model (for vLLM the HF-shaped view of the engine's resident weights)."""
        return self._backend.model

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    @property
    def engine(self):
        """The vLLM engine, or None for the HF backend."""
        return self._backend.engine

    @property
    def messages(self):
        """The bound chat history (the caller's list, read at each use)."""
        return self._receiver.messages

    @property
    def max_new_tokens(self) -> int:
        return self._receiver.max_new_tokens

    @property
    def context_limit(self) -> int:
        return self._receiver.context_limit

    @property
    def placement(self) -> str:
        return self._receiver.placement

    def __len__(self) -> int:
        """Number of queued handoffs."""
        return len(self._receiver)

    # ---------------------------------------------------------------------------------------
    # read-only views (no forward pass; `inspect` and `rclc.check` build on these)

    def describe(self) -> dict:
        """JSON-serialisable configuration of the bound model and tokenizer (no forward pass)."""
        return self._backend.describe()

    def queued(self) -> list[tuple[Delivery, RenderedPrompt]]:
        """Each queued handoff with its prompt snapshot, in queue order (nothing is consumed)."""
        return self._receiver.queued()

    @property
    def pending(self) -> PendingInputs | None:
        """The inputs from the latest `pop` or `inputs` not yet recorded with `update`, or None."""
        return self._pending

    @property
    def state_source(self) -> str:
        """Where the sender state comes from: "explicit", "history" (the bound messages, or their
        last prefill when the list has been emptied since) or "none"."""
        if self._explicit is not None:
            return "explicit"
        return "history" if self.messages or self._history is not None else "none"

    @property
    def prepared_state(self) -> SenderState | None:
        """The sender state as last prepared, without running a forward: the explicit state, else
        the history as last prefilled (which may predate later changes to ``messages``), else None."""
        if self._explicit is not None:
            return self._explicit
        return None if self._history is None else self._history[1]

    # ---------------------------------------------------------------------------------------
    # guards

    def _check_idle(self, operation: str) -> None:
        if self._busy is not None:
            raise RuntimeError(f"{operation} while {self._busy} is in progress on this agent; await it first")

    @contextlib.contextmanager
    def _running(self, operation: str) -> Iterator[None]:
        """Mark ``operation`` in progress for the block, so `_check_idle` refuses others meanwhile."""
        self._busy = operation
        try:
            yield
        finally:
            self._busy = None

    def _check_no_pending(self, operation: str) -> None:
        if self._pending is not None:
            raise RuntimeError(
                f"cannot {operation}: inputs from {self._pending.source}() are pending; record the continuation "
                "with update(inputs=inputs, generation=output) first (or pop(discard_pending=True) for an "
                "answer that will not be sent onward)"
            )

    def _check_no_queue(self, operation: str) -> None:
        if len(self._receiver):
            raise RuntimeError(f"cannot {operation} with {len(self._receiver)} queued handoff(s); pop() them first")

    def _check_fits(self, positions: int) -> None:
        if positions > self.context_limit:
            raise ValueError(f"the state would hold {positions} positions, more than the context limit of {self.context_limit}")

    # ---------------------------------------------------------------------------------------
    # sender state

    def _no_state_error(self) -> ValueError:
        return ValueError(
            "the agent has no sender state: bind messages=..., prompt=... or generation=..., "
            "append text or IDs, or load a snapshot"
        )

    def _history_ids(self) -> torch.Tensor:
        if not self.messages:
            raise self._no_state_error()
        return self._backend.history_ids(self.messages)

    def _prepare_state(self) -> tuple[SenderState, tuple[torch.Tensor, SenderState] | None]:
        """The current sender state and, in history mode, the new history cache entry (not stored)."""
        if self._explicit is not None:
            return self._explicit, None
        ids = self._history_ids()
        self._check_fits(int(ids.shape[1]))
        with MODEL_LOCK:
            state = self._backend.history_state(ids, self._history)
        return state, (ids, state)

    def sender_state(self) -> SenderState:
        """The state this agent sends (blocking: a history prefill runs here when needed).

        Raises:
            RuntimeError: inputs are pending, or another operation is in progress.
            ValueError: no messages and no explicit state.
        """
        self._check_idle("sender_state()")
        self._check_no_pending("send state")
        state, history = self._prepare_state()
        if history is not None:
            self._history = history
        return state

    async def _rclc_sender_state(self) -> SenderState:
        """`sender_state` for `transfer`: the history prefill runs in a worker."""
        self._check_idle("transfer")
        self._check_no_pending("send state")
        if self._explicit is not None:
            return self._explicit
        with self._running("a history prefill"):
            state, history = await run_in_worker(self._prepare_state, lock=False)
        self._history = history
        return state

    def _current_rows(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Rows [T, hidden], IDs [T], inherited and latent counts of the current state, without a forward."""
        if self._explicit is not None:
            s = self._explicit
            ids = s.token_ids if s.token_ids is not None else torch.full((s.positions,), -1, dtype=torch.long)
            return s.input_embeds, ids.cpu(), s.inherited_positions, s.latent_steps
        ids = self._history_ids()
        if self._history is not None and torch.equal(self._history[0], ids):
            return self._history[1].input_embeds, ids[0], 0, 0
        with MODEL_LOCK:
            return self._backend.embed(ids[0]), ids[0], 0, 0

    def _current_cache(self, rows: torch.Tensor):
        """The cache the agent holds for exactly ``rows`` (the explicit state's, or the prefilled
        history's), or None."""
        held = self._explicit if self._explicit is not None else (self._history or (None, None))[1]
        return held.past_key_values if held is not None and held.input_embeds is rows else None

    # ---------------------------------------------------------------------------------------
    # the receiver protocol (`RowReceiver`: transfer calls these), delegated to the inbox

    def _rclc_check_sender(self, state: SenderState) -> None:
        self._receiver._rclc_check_sender(state)

    def _rclc_plan(self, request) -> ReceiverPlan:
        return self._receiver._rclc_plan(request)

    def _rclc_accept(self, delivery: Delivery, plan: ReceiverPlan) -> None:
        self._receiver._rclc_accept(delivery, plan)

    # ---------------------------------------------------------------------------------------
    # continuations


    async def append(self, content) -> None:
        """Extend the retained state with rendered text or exact int64 [1, tokens] IDs.

        No chat template is applied and nothing is generated; ``messages`` is left alone.
        Received vectors and inherited counts survive (a former latent tail stops being a tail).
        The extension runs on a private cache copy in a worker.

        Raises:
            RuntimeError: inputs are pending, or another operation is in progress.
            ValueError / TypeError: invalid content, no tokenizer for text, context overflow.
            The previous state is kept on any failure or cancellation.
        """
        self._check_idle("append()")
        self._check_no_pending("append")
        ids = self._backend.content_ids(content)
        with self._running("append()"):
            state, history = await run_in_worker(self._appended_state, ids, lock=False)
        if history is not None:
            self._history = history
        self._explicit = state

    def _appended_state(self, ids: torch.Tensor) -> tuple[SenderState, tuple[torch.Tensor, SenderState] | None]:
        """The extended state and, when the history was prefilled for it, the new history cache entry."""
        if self._explicit is None and not self.messages:
            self._check_fits(int(ids.shape[1]))
            with MODEL_LOCK:
                return self._backend.source_state(ids), None
        if self._explicit is not None:
            current = self._explicit.positions
        else:
            current = int(self._history_ids().shape[1])
        self._check_fits(current + int(ids.shape[1]))
        base, history = self._prepare_state()
        with MODEL_LOCK:
            return self._backend.extend(base, ids), history

    # ---------------------------------------------------------------------------------------
    # snapshots

    async def save(self, path, *, key: bytes | None = None) -> None:
        """Atomically write the retained rows, aligned IDs and counts to a safetensors file.

        The metadata carries the LM fingerprint (weights, forward config, vocabulary) and a
        sha256 digest (against accidents); with ``key`` (bytes, >= 16) also an HMAC of the digest,
        which `load` with the same key verifies (against edits). No weights, caches, history,
        queue or sampling settings are written. Cancellation waits for the write, which may
        already have completed.

        Raises:
            RuntimeError: inputs are pending or handoffs are queued.
            ValueError: no state, or no tokenizer.
            IsADirectoryError: ``path`` is a folder (nothing is written).
        """
        self._check_idle("save()")
        self._check_no_pending("save")
        self._check_no_queue("save")
        if Path(path).is_dir():
            raise IsADirectoryError(f"cannot save a snapshot to {str(path)!r}: it is a folder; pass a file path "
                                    "such as agent.safetensors")
        if key is not None:
            check_key(key)
        with self._running("save()"):
            await run_in_worker(self._write_snapshot, Path(path), key, lock=False)

    def _write_snapshot(self, path: Path, key: bytes | None = None) -> None:
        with MODEL_LOCK:
            rows, ids, inherited, latent = self._current_rows()
            fingerprint = self._backend.fingerprint()
            identity = self._backend.describe()
        snapshots.write_snapshot(path, rows, ids, inherited_positions=inherited, latent_steps=latent,
                                 fingerprint=fingerprint, identity=identity, key=key)

    async def load(self, path, *, key: bytes | None = None) -> None:
        """Restore a snapshot as the explicit state (validated first, then re-prefilled); with
        ``key``, only a snapshot saved with that key (its signature verifies).

        Raises:
            RuntimeError: inputs are pending or handoffs are queued.
            SnapshotError: an unreadable, truncated, corrupted or foreign file, another model
                (fingerprint), dtype or hidden size, rows that do not match their IDs, more
                positions than the context limit. The previous state is kept on any failure or
                cancellation.
        """
        self._check_idle("load()")
        self._check_no_pending("load")
        self._check_no_queue("load")
        if key is not None:
            check_key(key)
        with self._running("load()"):
            state = await run_in_worker(self._read_snapshot, Path(path), key, lock=False)
        self._explicit = state

    def _read_snapshot(self, path: Path, key: bytes | None = None) -> SenderState:
        try:
            return self._restore_snapshot(path, key)
        except snapshots.SnapshotError as e:  # name the file: an agent loop may restore several
            if str(path) in str(e):
                raise
            raise snapshots.SnapshotError(f"snapshot {str(path)!r}: {e}") from None

    def _restore_snapshot(self, path: Path, key: bytes | None = None) -> SenderState:
        snap = snapshots.read_snapshot(path, key)
        backend = self._backend
        with MODEL_LOCK:
            snapshots.check_compatible(snap, fingerprint=backend.fingerprint(), dtype=backend.dtype,
                                       hidden_size=backend.hidden_size, vocab_size=backend.vocab_size,
                                       context_limit=self.context_limit)
            rows = snap.input_embeds.to(backend.device)
            ids = snap.token_ids
            if not rows_match_ids(rows, ids, backend.embed):
                raise snapshots.SnapshotError("the snapshot's rows do not match the embeddings of its token IDs")
            return backend.rows_state(rows, ids, snap.inherited_positions, snap.latent_steps)

    # ---------------------------------------------------------------------------------------
    # inspection

    def inspect(self, selection: bool = False) -> dict:
        """A JSON-serialisable report (`ilcp.rclc.report`): queued deliveries (per-sender
        positions, tensor bytes, remaining positions), pending inputs, the prepared sender state.
        No forward pass; nothing is consumed. ``selection=True`` adds each delivery's selection
        records."""
        return agent_report(self, selection=selection)

    def selection_html(self, request_index: int = 0) -> str:
        """HTML of a queued delivery's recorded selection (kept spans in green).

        Raises:
            IndexError: no queued handoff at ``request_index``.
            ValueError: the transfer did not record selections.
        """
        queued = self.queued()
        if isinstance(request_index, bool) or not isinstance(request_index, int):
            raise TypeError(f"request_index must be an int, got {type(request_index).__name__}")
        if not 0 <= request_index < len(queued):
            raise IndexError(f"no queued handoff at request_index={request_index} ({len(queued)} queued)")
        return queued[request_index][0].selection_html()

    def __repr__(self) -> str:
        return (
            f"Agent(backend={self.backend!r}, model={type(self.model).__name__}, state={self.state_source}, "
            f"queued={len(self)}, pending={self._pending is not None})"
        )


bind = Agent

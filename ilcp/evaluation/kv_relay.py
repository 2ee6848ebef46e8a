"""The KV relay rows: ``kv_relay:<selector>:r<N>`` and ``kv_relay:<selector>:b<N>`` (``:prefix``).

A comparison row, not part of RCLC (the RCLC spec never splices foreign KV into a receiver): the
sender hands over its own key/value cache entries at the positions a selector keeps, and the
receiver, the same model, decodes the question after that pruned cache (kvpress / LatentMAS
style).

    kv_relay:cacheback:r4     cacheback selection, ceil(T / 4) cached positions
    kv_relay:qsnap:b16        qsnap selection, at most 16 cached positions

Selectors and budgets are the ``rclc:...`` rows' (`ilcp.evaluation.rclc_methods`): the same
names, the same question-aware selection through `ilcp.rclc.transfer_sync`, from the same sender
state (`ilcp.rclc.sender_from_hf` over the cold-read framing's context text, one prefill), so a
``kv_relay`` row and the ``rclc`` row of the same selector and budget keep the same positions.

Sender (timed as sender time): build the state, select, and copy the kept positions' keys and
values out of every layer of its cache (`KVHandoff`). Its bytes are the KV's: layers x 2 x
kv_heads x head_dim x kept positions x element size (wire bytes = tensor bytes; no framing).

Placement, as for the ``rclc`` rows. By default the entries stand where the context text stands
in the cold-read prompt: the sender computes its cache over that prompt's head (system turn and
"Context:", the part before the context, which holds no question) followed by the context,
selects among the context's positions exactly as above, and hands over the kept context entries;
the receiver holds the head's entries (its own prompt: not counted in the bytes) and the relayed
ones, and decodes the rest of the cold-read prompt (the question and the assistant header) after
them. At ``r1`` this is the cold read itself, computed by the sender. With ``:prefix`` the
receiver decodes the question prompt (`ilcp.receiver.prompts.question_prompt`, a fresh chat turn) after
the entries of the context alone; this 135M receiver does not read a context placed so.

Receiver (timed as receiver time): a fresh cache holding the kept entries (`receive`), then the
prompt decoded after it. The kept keys carry the rotary positions the sender gave them, so the
receiver's tokens continue at position T (the sender's full length) and attend to every kept
position and to each other; greedy, with `ilcp.receiver.decoding`'s stop rule and the evaluation's
max_new_tokens.

The prefix is a KV cache, not embedding rows, so these rows decode themselves
(``decodes_itself``: `decode_rows` on the accuracy path, `decode_received` on the timed path)
and cannot run on vLLM. Caches of sliding-window layers (which hold fewer than T positions) are
refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import compat, rclc
from ..receiver.decoding import DecodeResult, decoded_answer, has_line, stop_token_ids  # the shared stop rule
from ..receiver.prompts import question_prompt
from ..rclc.hf import context_limit
from .rclc_methods import SELECTORS, parse_selection_name, receiver_framing, sender_states
from .registry import Decoded, EvalContext, HandoffMethod, Sent

__all__ = ["KVHandoff", "KVRelayMethod", "KVRelaySpec", "RelayInputs", "kv_cache_from", "parse_kv_relay_name",
           "prune_kv", "relay_decode"]

FAMILY = "kv_relay"
_USAGE = "use kv_relay:<selector>:r<N>[:prefix] or kv_relay:<selector>:b<N>[:prefix], e.g. kv_relay:cacheback:r4"


@dataclass(frozen=True)
class KVRelaySpec:
    """A parsed ``kv_relay:...`` name: the selector and exactly one of ratio (r<N>) and budget (b<N>)."""

    selector: str
    ratio: int | None
    budget: int | None
    placement: str = "in_prompt"


def parse_kv_relay_name(name: str) -> KVRelaySpec:
    """Parse ``kv_relay:<selector>:<r|b><N>[:prefix]``.

    Raises:
        ValueError: another family, a missing or unknown selector, a missing or malformed budget,
            N < 1, or anything after the budget but ``:prefix``.
    """
    selector, kind, value, options = parse_selection_name(name, FAMILY, _USAGE, "positions")
    if options not in ([], ["prefix"]):
        raise ValueError(f"{name!r}: kv_relay rows take only the option 'prefix' (got {':'.join(options)!r}); {_USAGE}")
    return KVRelaySpec(selector=selector, ratio=value if kind == "r" else None, budget=value if kind == "b" else None,
                       placement="prefix" if options else "in_prompt")


@dataclass(frozen=True)
class KVHandoff:
    """What a KV relay sender hands over: its cache entries at the kept positions.

    Attributes:
        positions: int64 [k] the kept positions of the sender's T, sorted.
        total: T, the sender's full length (the receiver's tokens continue there).
        keys, values: one [kv_heads, k, head_dim] tensor per layer (copies, not views).
    """

    positions: Tensor
    total: int
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    own: int = 0

    @property
    def kept(self) -> int:
        return int(self.positions.numel())

    @property
    def nbytes(self) -> int:
        """layers x 2 x kv_heads x head_dim x kept positions x element size, less the first ``own``
        positions (the receiver's own prompt head, which it would compute itself)."""
        full = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        return full * (self.kept - self.own) // max(self.kept, 1)


def prune_kv(cache, positions: Tensor, total: int, own: int = 0) -> KVHandoff:
    """Copy the entries at ``positions`` out of every layer of a one-sequence cache of ``total``
    positions (the first ``own`` of them the receiver's own prompt head).

    Raises:
        ValueError: a cache layout `ilcp.compat.cache_tensors` cannot read, a batch other than
            one, or a layer that holds fewer than ``total`` positions (a sliding window).
    """
    pairs = compat.cache_tensors(cache)
    if pairs is None:
        raise ValueError(f"kv_relay cannot read the key/value tensors of a {type(cache).__name__}")
    keys, values = [], []
    for i, (k, v) in enumerate(pairs):
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != total or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"kv_relay: layer {i} caches keys {tuple(k.shape)} and values {tuple(v.shape)}; it "
                             f"needs one sequence of all {total} positions (sliding-window layers are not supported)")
        index = positions.to(k.device)
        keys.append(k[0].index_select(1, index).clone())
        values.append(v[0].index_select(1, index).clone())
    return KVHandoff(positions=positions.detach().cpu().clone(), total=total, keys=tuple(keys), values=tuple(values),
                     own=own)


def kv_cache_from(model, kv: KVHandoff):
    """A fresh cache for ``model`` holding exactly the handed-over entries (batch of one)."""
    weight = model.get_input_embeddings().weight
    cache = compat.new_dynamic_cache(model)
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        cache.update(k.unsqueeze(0).to(weight.device), v.unsqueeze(0).to(weight.device), layer)
    return cache


@dataclass
class RelayInputs:
    """What the receiver decodes from: the cache of kept entries, the question prompt's token
    IDs (int64 [q]) and T, where their positions start."""

    cache: object
    kept: int
    total: int
    prompt_ids: Tensor


def relay_decode(model, tokenizer, inputs: RelayInputs, *, max_new_tokens: int, stop_at_newline: bool = True,
                 stops: set[int] | None = None, details: bool = False):
    """Greedy decode of the prompt after the relayed cache (which is extended in place).

    The prompt's tokens get positions ``T .. T + q - 1`` and an attention mask over the k kept
    and q new positions; each generated token continues one position further. The stop rule is
    `ilcp.receiver.decoding.greedy_decode`'s (stop tokens, and with ``stop_at_newline`` a complete first line).

    Returns:
        a `DecodeResult` (``prefill_positions`` = k + q, the positions the first token attends
        to); with ``details``, ``(result, answer token ids, the first token's logits)``: the ids
        as `ilcp.receiver.decoding.greedy_decode_ids` gives them (stop token excluded), the logits [vocab]
        float32 on the CPU.
    """
    stops = stop_token_ids(model, tokenizer) if stops is None else stops
    device = model.get_input_embeddings().weight.device
    q = int(inputs.prompt_ids.numel())
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        cache = inputs.cache
        mask = torch.ones(1, inputs.kept + q, dtype=torch.long, device=device)
        position = torch.arange(inputs.total, inputs.total + q, device=device).unsqueeze(0)
        out = model(input_ids=inputs.prompt_ids.to(device).unsqueeze(0), attention_mask=mask, position_ids=position,
                    use_cache=True, **compat.cache_kwargs(model, cache), **compat.logits_to_keep_kwargs(model, 1))
        logits = out.logits[0, -1]
        token = int(logits.argmax())
        first_logits = logits.float().cpu() if details else None
        prefill_s = time.perf_counter() - start
        generated: list[int] = []
        count = 0
        position = position[:, -1:]
        for step in range(max_new_tokens):
            count += 1
            if token in stops:
                break
            generated.append(token)
            if (stop_at_newline and has_line(tokenizer, generated)) or step == max_new_tokens - 1:
                break
            cache = compat.output_cache(out)
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
            position = position + 1
            out = model(input_ids=torch.tensor([[token]], device=device), attention_mask=mask, position_ids=position,
                        use_cache=True, **compat.cache_kwargs(model, cache))
            token = int(out.logits[0, -1].argmax())
    result = DecodeResult(text=decoded_answer(tokenizer, generated, stop_at_newline), prefill_s=prefill_s,
                          total_s=time.perf_counter() - start, new_tokens=count, prefill_positions=inputs.kept + q)
    return (result, generated, first_logits) if details else result


class KVRelayMethod(HandoffMethod):
    """One KV relay row: the sender's kept cache entries, the question decoded after them.

    ``send`` returns a `Sent` whose ``handed_over`` is a `KVHandoff`; ``receive`` returns the
    `RelayInputs` that `decode_received` decodes.
    """

    decodes_itself = True
    shares_sender_states = True
    vllm_unavailable = "its receiver starts from a relayed KV cache, which vLLM's prompt_embeds input cannot take"

    def __init__(self, name: str):
        super().__init__(name)
        self.spec = parse_kv_relay_name(name)
        self.selector = SELECTORS[self.spec.selector]
        self._lead: str | None = None
        self._stops: set[int] | None = None
        self._receiver: rclc.HFReceiver | None = None
        self._head: Tensor | None = None

    def bind(self, ctx: EvalContext) -> None:
        super().bind(ctx)
        framing = receiver_framing(ctx.lm.tokenizer)
        self._lead = framing.lead
        self._stops = stop_token_ids(ctx.lm.model, ctx.lm.tokenizer)
        # the cold-read prompt split around the context (the in-prompt rclc rows' receiver)
        self._receiver = rclc.HFReceiver(ctx.lm.model, ctx.lm.tokenizer, messages=framing.messages,
                                         placement="in_prompt", slot_template=framing.slot_template)
        # int64 [a]: the cold-read prompt before the context (the same for every question)
        self._head = self._receiver.render("?").before.reshape(-1)

    def sender_text(self, context: str) -> str:
        """The text the sender prefills: the context as the cold-read prompt holds it (as the rclc rows)."""
        if self._lead is None:
            raise RuntimeError(f"method {self.name!r} is not bound to a run: call bind(ctx) first")
        return self._lead + context.strip()

    def send(self, row: dict) -> Sent:
        lm = self.lm
        return self._select(rclc.sender_from_hf(lm.model, lm.tokenizer, self.sender_text(row["context"])), row)

    def _select(self, state: rclc.SenderState, row: dict) -> Sent:
        deliveries: list[rclc.Delivery] = []
        rclc.transfer_sync(state, deliveries.append, row["question"].strip(), ratio=self.spec.ratio,
                           budget=self.spec.budget, selector=self.selector, record_selection=True)
        kept = torch.tensor(deliveries[0].messages[0].selection.indices, dtype=torch.long)
        if self.spec.placement == "prefix":
            kv = prune_kv(state.past_key_values, kept, state.positions)
        else:  # the same positions, from a cache computed after the cold-read prompt's head
            head = self._head
            model = self.lm.model
            ids = torch.cat([head, state.token_ids.to(head.dtype)]).to(model.get_input_embeddings().weight.device)
            with torch.inference_mode():
                out = model(input_ids=ids.unsqueeze(0), use_cache=True)
            a = int(head.numel())
            kv = prune_kv(compat.output_cache(out), torch.cat([torch.arange(a), kept + a]), a + state.positions, own=a)
        return Sent(handed_over=kv, wire_bytes=kv.nbytes, tensor_bytes=kv.nbytes)

    def receive(self, sent: Sent, row: dict) -> RelayInputs:
        lm = self.lm
        kv = sent.handed_over
        if not isinstance(kv, KVHandoff):
            raise ValueError(f"{self.name}: expected a KVHandoff, got {type(kv).__name__}")
        if self.spec.placement == "prefix":
            ids = lm.tokenizer(question_prompt(lm.tokenizer, row["question"]), add_special_tokens=False)["input_ids"]
        else:  # the rest of the cold-read prompt: the question and the assistant header
            ids = self._receiver.render(row["question"].strip()).after.reshape(-1).tolist()
        limit = context_limit(lm.model)
        if kv.total + len(ids) > limit:
            raise ValueError(f"{self.name}: the sender's {kv.total} positions and the {len(ids)}-token question "
                             f"exceed the model's {limit} positions")
        return RelayInputs(cache=kv_cache_from(lm.model, kv), kept=kv.kept, total=kv.total,
                           prompt_ids=torch.tensor(ids, dtype=torch.long))

    def decode_received(self, received: RelayInputs, row: dict, *, max_new_tokens: int,
                        stop_at_newline: bool = True) -> DecodeResult:
        return relay_decode(self.lm.model, self.lm.tokenizer, received, max_new_tokens=max_new_tokens,
                            stop_at_newline=stop_at_newline, stops=self._stops)

    def decode_rows(self, rows: Sequence[dict], *, max_new_tokens: int, stop_at_newline: bool = True) -> Decoded:
        """Row by row (each row has its own cache); each context's sender state is built once for
        every rclc and kv_relay row of the evaluation (`SenderStates` in the context's extras; the
        selection works on a clone and the pruning copies, so sharing changes nothing)."""
        states = sender_states(self.ctx)
        answers, wire, positions = [], [], []
        decode_s = 0.0
        for row in rows:
            sent = self._select(states.get(self.sender_text(row["context"])), row)
            result = self.decode_received(self.receive(sent, row), row, max_new_tokens=max_new_tokens,
                                          stop_at_newline=stop_at_newline)
            answers.append(result.text)
            wire.append(sent.wire_bytes)
            positions.append(result.prefill_positions)
            decode_s += result.total_s
        return Decoded(answers=answers, wire_bytes=wire, tensor_bytes=list(wire), prefill_positions=positions,
                       decode_s=decode_s)

"""The built-in handoff methods, each registered under its name in `ilcp.names.METHODS`, and the
``default`` group (`DEFAULT_METHODS`).

What a method is, and how names resolve, is `ilcp.evaluation.registry`; the ``rclc:...`` family
is `ilcp.evaluation.rclc_methods`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..names import DEFAULT_METHODS
from ..receiver.prefix import MemoryLayout, receiver_prefix
from .registry import EvalContext, HandoffMethod, MethodUnavailable, Prefixes, Sent

__all__ = ["DEFAULT_METHODS", "ColdRead", "ColdReadTuned", "ILCPMethod", "NoContext", "PromptTuned"]


class NoContext(HandoffMethod):
    """The question alone, zero-shot: the floor."""

    name = "no_context"
    carries_context = False

    def send(self, row: dict) -> Sent:
        return Sent(handed_over=None, wire_bytes=0)

    def receive(self, sent: Sent, row: dict) -> Tensor:
        return receiver_prefix(self.lm.tokenizer, row["question"]).embeds(self.lm.model)


class PromptTuned(HandoffMethod):
    """K trained constant vectors + the question: what training alone buys (no transfer)."""

    name = "prompt_tuned"
    requires = ("prompt_tuned",)
    carries_context = False

    def send(self, row: dict) -> Sent:
        return Sent(handed_over=None, wire_bytes=0)

    def receive(self, sent: Sent, row: dict) -> Tensor:
        soft = self.ctx.run.soft_prompts["prompt_tuned"]
        return receiver_prefix(self.lm.tokenizer, row["question"], source=MemoryLayout(), memory=soft).embeds(self.lm.model)


class ColdRead(HandoffMethod):
    """The whole context text + the question, zero-shot: the text handoff as used today.

    The sender tokenises the context (the work a text handoff asks of it) and sends its utf-8
    bytes; the receiver decodes them and prefills the cold-read prompt.
    """

    name = "cold_read"
    soft_prompt: str | None = None

    def send(self, row: dict) -> Sent:
        data = row["context"].encode("utf-8")
        self.lm.tokenizer(row["context"], add_special_tokens=False)
        return Sent(handed_over=data, wire_bytes=len(data))

    def receive(self, sent: Sent, row: dict) -> Tensor:
        context = sent.handed_over.decode("utf-8")
        if self.soft_prompt is None:
            prefix = receiver_prefix(self.lm.tokenizer, row["question"], context=context)
        else:
            prefix = receiver_prefix(self.lm.tokenizer, row["question"], context=context,
                                     source=MemoryLayout(reads_context_text=True),
                                     memory=self.ctx.run.soft_prompts[self.soft_prompt])
        return prefix.embeds(self.lm.model)


class ColdReadTuned(ColdRead):
    """K trained constant vectors + the context text + the question: the text handoff at its best."""

    name = "cold_read_tuned"
    requires = ("cold_read_tuned",)
    soft_prompt = "cold_read_tuned"


class ILCPMethod(HandoffMethod):
    """K memory vectors projected from the received latent + the question: the ILCP path.

    Sender: pooling forward + encode + pack + to_bytes. Receiver: from_bytes (verifying the LM
    fingerprint) + unpack + project + the question prompt.
    """

    name = "ilcp"
    requires = ("ilcp",)

    def bind(self, ctx: EvalContext) -> None:
        super().bind(ctx)
        if ctx.handoff is None:
            raise MethodUnavailable("ilcp: no ILCPHandoff was built for this run")

    def send(self, row: dict) -> Sent:
        payload = self.ctx.handoff.send(row["context"])
        data = payload.to_bytes()
        return Sent(handed_over=data, wire_bytes=len(data), tensor_bytes=payload.byte_length())

    def receive(self, sent: Sent, row: dict) -> Tensor:
        return self.ctx.handoff.prefixes(sent.handed_over, [row["question"]])[0]

    def reused_sender_seconds(self, row: dict) -> float:
        """The sender's time when its own forward over the context already ran (an agent that
        just read it): `ILCPHandoff.send_from_hidden_states` and the bytes, timed; the forward
        before it is not."""
        handoff = self.ctx.handoff
        inputs = handoff.sender_inputs([row["context"]])
        with torch.no_grad(), handoff.compute():
            # memory slots continue the forward's key/value cache; the other encoders read its states
            outputs = self.lm.model(**inputs, output_hidden_states=True, use_cache=handoff.encoder.reads_sender_lm)
        start = time.perf_counter()
        handoff.send_from_hidden_states(outputs, inputs["attention_mask"]).to_bytes()
        return time.perf_counter() - start

    def build_prefixes(self, rows: Sequence[dict]) -> Prefixes:
        handoff = self.ctx.handoff
        # One payload per row: its size, not a batch's, is what one handoff sends.
        payloads = handoff.send_each([r["context"] for r in rows], batch_size=self.ctx.pool_batch_size,
                                     max_characters=None)  # the rows of a task, each bounded
        wires = [p.to_bytes() for p in payloads]
        prefixes = [handoff.prefixes(w, [r["question"]])[0] for w, r in zip(wires, rows)]
        return Prefixes(prefixes=prefixes, wire_bytes=[len(w) for w in wires],
                        tensor_bytes=[p.byte_length() for p in payloads])

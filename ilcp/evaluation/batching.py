"""Accuracy, batched: a method's receiver prefixes built and decoded chunk by chunk of questions
(`accuracy`), or several methods that share sender states taking turns on each chunk
(`accuracy_shared`); with a vLLM decoder the same prefixes are decoded through it too."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..receiver.decoding import greedy_decode
from ..engines.vllm import VLLMDecoder
from ..encoder.pooling import context_lengths
from ..progress import tracked
from .decoders import compare, vllm_unavailable
from .rclc_methods import SenderStates
from .registry import HandoffMethod
from .report import accepted_answers, accuracy_summary

__all__ = ["CHUNK", "Accuracy", "accuracy", "accuracy_shared"]

CHUNK = 64  # rows whose prefixes are built and decoded together (bounds memory)


class Accuracy:
    """One method's accuracy on a task, fed chunk by chunk (`add`), so that several methods can
    take turns on the same chunk of questions (`accuracy_shared`)."""

    def __init__(self, method: HandoffMethod, max_new_tokens: int, batch_size: int,
                 vllm: VLLMDecoder | None = None, open_text: bool = False):
        self.method, self.max_new_tokens, self.batch_size, self.vllm = method, max_new_tokens, batch_size, vllm
        self.open_text = open_text  # SQuAD's scoring (`accuracy_summary`)
        self.predictions: list[str] = []
        self.vllm_predictions: list[str] | None = [] if vllm is not None else None
        self.unavailable: str | None = None
        self.decode_s = self.vllm_s = 0.0
        self.wire, self.tensor, self.positions = [], [], []

    def add(self, chunk: Sequence[dict]) -> None:
        method, vllm, max_new_tokens = self.method, self.vllm, self.max_new_tokens
        if method.decodes_itself:  # its receiver starts from no (L, H) prefix (e.g. a KV cache)
            decoded = method.decode_rows(chunk, max_new_tokens=max_new_tokens, stop_at_newline=True)
            self.predictions += decoded.answers
            self.decode_s += decoded.decode_s
            self.wire += decoded.wire_bytes
            self.tensor += decoded.tensor_bytes
            self.positions += decoded.prefill_positions
            if vllm is not None and self.unavailable is None:
                self.unavailable = str(method.vllm_unavailable or "the method decodes itself")
            return
        built = method.build_prefixes(chunk)
        # Batches of similar lengths pad less; answers do not depend on the batching.
        order = sorted(range(len(chunk)), key=lambda i: built.prefixes[i].shape[0])
        ordered = [built.prefixes[i] for i in order]
        t0 = time.perf_counter()
        answers = greedy_decode(method.lm.model, method.lm.tokenizer, ordered, max_new_tokens=max_new_tokens,
                                batch_size=self.batch_size, stop_at_newline=True)
        self.decode_s += time.perf_counter() - t0
        self.predictions += _unsort(order, answers)
        if vllm is not None and self.unavailable is None:
            self.unavailable = vllm_unavailable(method, ordered, vllm, max_new_tokens)
        if vllm is not None and self.unavailable is None:
            t0 = time.perf_counter()
            try:
                answers = vllm.decode(ordered, max_new_tokens=max_new_tokens, stop_at_newline=True)
            except (ValueError, RuntimeError) as e:  # what the engine refuses, said in one line
                self.unavailable = " ".join(str(e).split()) or type(e).__name__
            else:
                self.vllm_s += time.perf_counter() - t0
                self.vllm_predictions += _unsort(order, answers)
        self.wire += built.wire_bytes
        self.tensor += built.tensor_bytes
        self.positions += [int(p.shape[0]) for p in built.prefixes]

    def result(self, rows: Sequence[dict]) -> tuple[dict, list[str], list[str] | None]:
        def mean(x):
            return sum(x) / len(x) if x else 0.0

        metrics = {
            **accuracy_summary(self.predictions, [accepted_answers(r) for r in rows], open_text=self.open_text),
            "wire_bytes": mean(self.wire),
            "tensor_bytes": mean(self.tensor),
            "prefill_positions": mean(self.positions),
            "decode_s": round(self.decode_s, 3),
        }
        vllm_predictions = self.vllm_predictions
        if self.vllm is not None:
            if self.unavailable is not None:
                metrics["vllm"] = {"unavailable": f"unavailable on vllm: {self.unavailable}"}
                vllm_predictions = None
            else:
                metrics["vllm"] = compare(rows, self.predictions, vllm_predictions, self.vllm_s,
                                          open_text=self.open_text)
        return metrics, self.predictions, vllm_predictions


def _unsort(order: Sequence[int], answers: Sequence[str]) -> list[str]:
    in_order = [""] * len(order)
    for i, answer in zip(order, answers):
        in_order[i] = answer
    return in_order


def accuracy(method: HandoffMethod, rows: Sequence[dict], *, batch_size: int, max_new_tokens: int,
             progress: bool, desc: str, vllm: VLLMDecoder | None = None,
             open_text: bool = False) -> tuple[dict, list[str], list[str] | None]:
    """Metrics and predictions of the HF decoder; with ``vllm``, the same prefixes decoded through
    it too: ``metrics["vllm"]`` (`compare`, or ``{"unavailable": why}``) and its predictions.
    ``open_text``: scored as SQuAD (the task's answers are open text)."""
    acc = Accuracy(method, max_new_tokens, batch_size, vllm, open_text)
    for start in tracked(range(0, len(rows), CHUNK), desc, progress=progress, total=len(rows),
                         size=lambda start: min(CHUNK, len(rows) - start)):
        acc.add(rows[start:start + CHUNK])
    return acc.result(rows)


def accuracy_shared(methods: Sequence[HandoffMethod], rows: Sequence[dict], states: SenderStates, *,
                    batch_size: int, max_new_tokens: int, progress: bool, desc: str,
                    vllm: VLLMDecoder | None = None,
                    open_text: bool = False) -> list[tuple[dict, list[str], list[str] | None, float]]:
    """`accuracy` of several methods that share sender states (RCLC and kv_relay rows), with the
    questions outside and the methods inside: each chunk holds as many contexts as ``states``
    keeps at once, so every context's sender state is built once for all the methods, however
    long the contexts (methods outside would rebuild them once a method's contexts overflow the
    bound). Returns, per method, `accuracy`'s triple and the seconds spent on it."""
    lengths = context_lengths(methods[0].lm.tokenizer, [methods[0].sender_text(r["context"]) for r in rows])
    per_chunk = max(1, min(CHUNK, states.capacity, states.max_positions // max(max(lengths, default=1), 1)))
    accs = [Accuracy(m, max_new_tokens, batch_size, vllm, open_text) for m in methods]
    seconds = [0.0] * len(methods)
    for start in tracked(range(0, len(rows), per_chunk), desc, progress=progress, total=len(rows),
                         size=lambda start: min(per_chunk, len(rows) - start)):
        chunk = rows[start:start + per_chunk]
        for i, acc in enumerate(accs):
            t0 = time.perf_counter()
            acc.add(chunk)
            seconds[i] += time.perf_counter() - t0
    return [(*acc.result(rows), s) for acc, s in zip(accs, seconds)]

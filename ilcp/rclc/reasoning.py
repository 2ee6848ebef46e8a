"""Latent reasoning: append continuous rows to a sender before it sends.

`latent_mass` is the rule of the RCLC paper: feed the final hidden row back as the next input,
rescaled to the mean norm of the input embeddings. A custom method has the signature

    async def method(state: SenderState, *, max_positions: int, request: Tensor | None = None) -> SenderState

(or the same as a plain function) and returns the state extended by 0 to ``max_positions`` rows;
`check_extension` enforces the contract.
"""

from __future__ import annotations

import inspect

import torch

from ilcp import compat
from ilcp.lm import mean_token_embedding_norm
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK, run_in_worker
from ilcp.rclc.state import SenderState

REASONING_CONTEXTS = ("full", "full_with_request", "selected", "selected_with_request")


def _steps(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def latent_mass_sync(state: SenderState, steps: int, request: torch.Tensor | str | None = None, *, max_positions: int | None = None) -> SenderState:
    """Blocking form of `latent_mass`."""
    if not isinstance(state, SenderState):
        raise TypeError(f"state must be a SenderState, got {type(state).__name__}")
    n = _steps(steps, "steps")
    if max_positions is not None:
        n = min(n, _steps(max_positions, "max_positions"))
    if n == 0:
        return state
    state.validate()
    model = state.model
    if isinstance(request, str):
        request = hf.encode_text(state.tokenizer, request, hf.text_limit(model), what="the request")
    if request is not None:
        request = hf.check_ids(request, hf.vocab_size(model), "request IDs")
    with MODEL_LOCK:
        weight = hf.embedding_weight(model)
        target_norm = torch.tensor(mean_token_embedding_norm(model), device=weight.device)
        cache = compat.clone_cache(state.past_key_values)
        if request is not None:
            outputs = hf.forward_rows(model, hf.embed_ids(model, request[0]), cache, output_hidden_states=True)
            cache = compat.output_cache(outputs)
        else:
            # The last row's hidden state is not stored: recompute it on a scratch copy cropped
            # before it, so the rollout's cache keeps the state's exact prefix.
            scratch = compat.clone_cache(state.past_key_values)
            compat.crop_cache(scratch, state.positions - 1)
            outputs = hf.forward_rows(model, state.input_embeds[-1:], scratch, output_hidden_states=True)
            del scratch
        new_rows = []
        for _ in range(n):
            hidden = hf.last_hidden_row(outputs).float()
            row = (hidden * (target_norm / hidden.norm().clamp_min(1e-12))).to(weight.dtype)
            new_rows.append(row)
            outputs = hf.forward_rows(model, row.unsqueeze(0), cache, output_hidden_states=True)
            cache = compat.output_cache(outputs)
        rows = torch.stack(new_rows)
        if request is not None:
            # The request only conditioned the rollout: replay the new rows over the original prefix.
            cache = hf.prefill(model, rows, compat.clone_cache(state.past_key_values))
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("the latent rollout produced non-finite rows")
    token_ids = None
    if state.token_ids is not None:
        token_ids = torch.cat([state.token_ids, torch.full((n,), -1, dtype=torch.long, device=state.token_ids.device)])
    return SenderState(
        model=model,
        past_key_values=cache,
        input_embeds=torch.cat([state.input_embeds, rows]),
        tokenizer=state.tokenizer,
        latent_steps=state.latent_steps + n,
        token_ids=token_ids,
        inherited_positions=state.inherited_positions,
    )


async def latent_mass(state: SenderState, steps: int, request: torch.Tensor | str | None = None, *, max_positions: int | None = None) -> SenderState:
    """Append ``min(steps, max_positions)`` latent rows, each the previous final hidden row
    rescaled to the mean input-embedding norm; runs in a worker on a private cache copy.

    Args:
        state: the state to extend (left unchanged).
        steps: rows to append; 0 returns ``state`` itself.
        request: optional int64 [1, R] tokens (or text, tokenized with the state's tokenizer
            without a chat template) that condition the rollout; they are not kept (the new rows
            are replayed over the original prefix).
        max_positions: an upper bound on appended rows (transfer passes its reasoning budget).
    Returns:
        a new SenderState with ``latent_steps`` increased by the rows appended (token IDs -1).
    """
    return await run_in_worker(latent_mass_sync, state, steps, request, max_positions=max_positions)


def _is_async(method) -> bool:
    return inspect.iscoroutinefunction(method) or inspect.iscoroutinefunction(getattr(method, "__call__", None))


async def run_method(method, state: SenderState, max_positions: int, request: torch.Tensor | None) -> SenderState:
    """Run a reasoning method on private copies and check its result against ``state``.

    Async methods run on the caller's loop; synchronous ones in a worker holding the model lock.
    """
    private = state.private_copy()
    request_copy = None if request is None else request.clone()
    if _is_async(method):
        result = await method(private, max_positions=max_positions, request=request_copy)
    else:
        result = await run_in_worker(method, private, max_positions=max_positions, request=request_copy)
        if inspect.isawaitable(result):
            result = await result
    check_extension(state, result, max_positions)
    return result


def check_extension(before: SenderState, after, max_positions: int) -> None:
    """Check that ``after`` extends ``before`` by 0..max_positions latent rows.

    Raises:
        TypeError / ValueError: another type, another model or tokenizer, a changed inherited
        count, input prefix, token-ID prefix or cache prefix, too many rows, or a latent count
        that does not grow by the rows appended.
    """
    if not isinstance(after, SenderState):
        raise TypeError(f"a reasoning method must return a SenderState, got {type(after).__name__}")
    after.validate()
    if after.model is not before.model or after.tokenizer is not before.tokenizer:
        raise ValueError("a reasoning method must keep the sender's model and tokenizer")
    if after.inherited_positions != before.inherited_positions:
        raise ValueError("a reasoning method must keep inherited_positions")
    added = after.positions - before.positions
    if added < 0 or added > max_positions:
        raise ValueError(f"a reasoning method appended {added} rows; allowed 0 to {max_positions}")
    if after.latent_steps != before.latent_steps + added:
        raise ValueError(f"latent_steps must grow by the {added} appended rows: {before.latent_steps} -> {after.latent_steps}")
    if not torch.equal(after.input_embeds[: before.positions], before.input_embeds):
        raise ValueError("a reasoning method changed the sender's input rows")
    if (before.token_ids is None) != (after.token_ids is None):
        raise ValueError("a reasoning method must keep token_ids (present or absent) as they were")
    if before.token_ids is not None and not torch.equal(after.token_ids[: before.positions], before.token_ids):
        raise ValueError("a reasoning method changed the sender's token IDs")
    old, new = compat.cache_tensors(before.past_key_values), compat.cache_tensors(after.past_key_values)
    if old is not None and new is not None:
        if len(old) != len(new):
            raise ValueError("a reasoning method changed the number of cache layers")
        n = before.positions
        for (k0, v0), (k1, v1) in zip(old, new):
            if not (torch.equal(k1[..., :n, :], k0) and torch.equal(v1[..., :n, :], v0)):
                raise ValueError("a reasoning method changed the cache prefix")

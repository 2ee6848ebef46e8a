"""Causal self-attention for long bfloat16 prefills on CPU, computed in blocks of queries.

On a CPU with AVX512-BF16 but no AMX, torch's fused CPU attention kernel runs no faster in
bfloat16 than in float32, and at 2k positions it is half of a held LM's forward. The same
attention written as two bfloat16 matmuls per block of queries (the scores against the keys up to
the block's end, then the probabilities against the values) goes through the oneDNN bfloat16
matmuls that make the linear layers fast, and skips the masked upper triangle block by block:
measured on SmolLM2's shapes (9 heads, 3 key/value heads, head size 64), 17 ms a layer against
34 ms for SDPA at 2,096 positions, 5 against 10 at 1,024, 58 against 119 at 4,096
(benchmarks/receiver_speed.py shows the whole forward).

Numerics: the scores are rounded to bfloat16 before the softmax, the exponentials are bfloat16
(as inside the fused kernel) and their sums float32, the normalisation is applied to the output.
On random inputs the mean absolute error against float32 attention is about 2x that of SDPA in
bfloat16 (2.6e-4 against 1.1e-4); on SmolLM2 over 2k-token prompts its next-token logits are as
close to float32's as SDPA's in bfloat16 (docs/results/receiver-speed).

`attention_forward` is registered with transformers as ``ATTENTION_NAME`` (`ilcp.compat.
use_attention`) and used by an LM held in bfloat16 (`ilcp.precision.hold`). It takes the
blocked path only where it is exact in structure and faster: a CPU forward without gradients,
bfloat16 compute, a plain causal mask (no padding), queries and keys of the same length, at least
``MIN_QUERIES`` of them. Everything else (decoding steps, padded batches, training forwards whose
gradients reach a prefix, short requests) goes to SDPA.

Where a call carries a mask (a padded batch, queries over a cache: memory slots reading their
context) transformers' SDPA function repeats each key/value head for every query head it serves,
and a forward with gradients keeps those copies for the backward pass: 3x SmolLM2's keys and values
in every layer (a memory pretraining step on a batch of eight contexts of 760 to 1,395 tokens
peaked at 3.10 GB resident with them, 2.46 GB without). Such
a CPU call goes to torch's SDPA with ``enable_gqa`` instead (`takes_grouped_path`): the same fused
kernel reading each key/value head for its group of query heads, outputs equal to the repeated
heads' (the keys' and values' gradients summed in another order), and nothing repeated is kept.
Unmasked calls and CUDA keep transformers' function (on CUDA a mask with ``enable_gqa`` falls
back to the unfused kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

ATTENTION_NAME = "ilcp_blocked_sdpa"
MIN_QUERIES = 256  # below this both take under a millisecond a layer; SDPA keeps short requests as they were
BLOCK = 64  # queries per block; at 2,096 positions 17 ms a layer, 21 ms for 128, 26 ms for 256


def blocked_causal_attention(query: Tensor, key: Tensor, value: Tensor, scaling: float,
                             block: int = BLOCK) -> Tensor:
    """Causal attention of ``query`` [batch, heads, n, d] over ``key``/``value`` [batch,
    kv_heads, n, d] (heads a multiple of kv_heads, query i sees keys 0..i), in ``query``'s dtype.

    Returns [batch, n, heads, d], the layout transformers' attention functions return.
    """
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads or key.shape[2] != n or value.shape[2] != n:
        raise ValueError(f"blocked attention needs heads divisible by kv heads and as many keys as "
                         f"queries; got query {tuple(query.shape)}, key {tuple(key.shape)}")
    group = heads // kv_heads
    queries = (query * scaling).view(batch, kv_heads, group, n, dim)
    keys_t = key.transpose(-1, -2).contiguous()
    out = torch.empty_like(queries)
    for start in range(0, n, block):
        end = min(n, start + block)
        size = end - start
        scores = torch.matmul(queries[:, :, :, start:end].reshape(batch, kv_heads, group * size, dim),
                              keys_t[..., :end]).view(batch, kv_heads, group, size, end)
        above = torch.ones(size, size, dtype=torch.bool, device=query.device).triu_(1)
        scores[..., start:end].masked_fill_(above, float("-inf"))
        scores -= scores.amax(dim=-1, keepdim=True)
        probs = scores.exp_()
        total = probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
        mixed = torch.matmul(probs.view(batch, kv_heads, group * size, end), value[:, :, :end])
        out[:, :, :, start:end] = (mixed.view(batch, kv_heads, group, size, dim).float() / total).to(out.dtype)
    return out.view(batch, heads, n, dim).transpose(1, 2).contiguous()


def _compute_dtype(query: Tensor) -> torch.dtype:
    """The dtype the attention's matmuls run in: autocast's where it is on for the device."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def takes_blocked_path(module, query: Tensor, key: Tensor, attention_mask, dropout: float = 0.0,
                       **kwargs) -> bool:
    """Whether `attention_forward` computes this call in blocks (see the module docstring)."""
    return (query.device.type == "cpu"
            and not torch.is_grad_enabled()
            and _compute_dtype(query) == torch.bfloat16
            and attention_mask is None
            and kwargs.get("is_causal") is not False
            and getattr(module, "is_causal", True)
            and kwargs.get("sliding_window") is None
            and not dropout
            and query.shape[2] == key.shape[2] >= MIN_QUERIES
            and query.shape[1] % key.shape[1] == 0)


def takes_grouped_path(module, query: Tensor, key: Tensor, attention_mask, **kwargs) -> bool:
    """Whether `attention_forward` hands this call to SDPA with its key/value heads as they are
    (``enable_gqa``): a masked CPU call of several queries over fewer key/value heads than query
    heads, which transformers' SDPA function would give copies of the keys and values repeated
    to every query head (see the module docstring)."""
    return (query.device.type == "cpu"
            and attention_mask is not None
            and query.shape[2] > 1
            and query.shape[1] != key.shape[1]
            and query.shape[1] % key.shape[1] == 0
            and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False))


def attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """A transformers attention function: blocked causal attention where `takes_blocked_path`,
    SDPA over the key/value heads as they are where `takes_grouped_path`, transformers' SDPA
    function otherwise. Returns ``(output [batch, n, heads, d], None)``."""
    if takes_blocked_path(module, query, key, attention_mask, dropout, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, k, v = (t.to(torch.bfloat16) for t in (query, key, value))
        return blocked_causal_attention(q, k, v, scale), None
    if takes_grouped_path(module, query, key, attention_mask, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)

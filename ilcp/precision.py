"""Compute precision: one setting for every forward through the frozen LM.

The setting (`trainer.precision` in a training config, ``--precision`` in eval, ``precision=`` of
`ILCPHandoff.from_pretrained`) is one of

- ``"32-true"``: float32 everywhere (the default);
- ``"bf16-mixed"``: the LM's matmuls run in bfloat16 under autocast; weights, trained modules,
  exports and payloads stay float32;
- ``"auto"``: ``"bf16-mixed"`` where the hardware computes bfloat16 natively (a CPU reporting
  AVX512-BF16 or AMX, a CUDA GPU that supports it), else ``"32-true"``.

`resolve` turns ``"auto"`` into the precision used, which runs record (export config.json, eval's
results.json). Lightning's trainers take the resolved name as is; code outside a trainer enters
`autocast` around its forwards.

Autocast alone casts every float32 weight of the frozen LM to bfloat16 at every forward: on a
short request that recast costs more than the bfloat16 matmuls save. `hold` casts them once: the
frozen LM's linear layers (the LM head included) keep bfloat16 copies of their weights, its
embedding table and norms stay float32, and its forwards always run under bfloat16 autocast, so a
held LM computes what autocast over its float32 weights computes, without the recast; only its
long causal prefills without gradients (256 positions and more, `ilcp.attention.MIN_QUERIES`)
take `ilcp.attention`'s blocked bfloat16 attention in place of SDPA.
The fingerprint is the float32 weights' (taken before the cast). The entry points that load
their own LM hold it at a bfloat16 precision (training, eval, `ILCPHandoff.from_pretrained`); an
LM a caller passes in is left as it is (autocast recasts it) unless the caller holds it:

    from ilcp.precision import autocast, hold, resolve
    precision = resolve("auto", device)        # "bf16-mixed" on an AVX512-BF16 or AMX CPU
    hold(lm, precision)                        # once; nothing for "32-true"
    with autocast(precision, device):
        out = lm.model(input_ids)
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from .names import PRECISIONS

__all__ = ["PRECISIONS", "autocast", "check_precision", "cpu_has_native_bf16", "held_dtype", "hold", "native_bf16",
           "resolve"]

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def check_precision(precision: str) -> str:
    """``precision`` if it is one of `PRECISIONS`, else ValueError naming them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags as Linux reports them in /proc/cpuinfo (empty elsewhere)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            flags.update(line.split(":", 1)[1].split())
    return flags


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in _NATIVE_BF16_FLAGS)


def native_bf16(device) -> bool:
    """Whether ``device`` (a torch.device or its name) computes bfloat16 natively."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve(precision: str, device="cpu") -> str:
    """The precision used on ``device``: ``"auto"`` becomes ``"bf16-mixed"`` or ``"32-true"``."""
    check_precision(precision)
    if precision == "auto":
        return "bf16-mixed" if native_bf16(device) else "32-true"
    return precision


def autocast(precision: str, device="cpu"):
    """A context in which forwards on ``device`` run at ``precision`` (resolved first): torch's
    bfloat16 autocast for ``"bf16-mixed"``, nothing for ``"32-true"``."""
    import torch

    if resolve(precision, device) == "32-true":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


_HELD = "_ilcp_held_dtype"  # set on a held model: the dtype its linear weights are held in


def held_dtype(model):
    """The dtype a model's linear weights are held in by `hold`, or None for a model not held."""
    return getattr(model, _HELD, None)


def hold(lm, precision: str) -> int:
    """Hold a frozen LM (an `ilcp.lm.LM`) in the compute dtype of ``precision``, once.

    At ``"bf16-mixed"`` (resolved on the LM's device) every ``nn.Linear`` weight and bias of the
    model is replaced by a frozen bfloat16 copy (a head tied to the embedding table gets its own
    copy; the table stays float32, copied out of a mapped weights file: `_own_float32_tensors`),
    and the model's forward (and its base model's) runs under bfloat16 autocast whoever calls it.
    Autocast computes those matmuls in bfloat16 anyway, so the outputs are the ones autocast gives
    over the float32 weights. A model running SDPA is switched to `ilcp.attention`, which computes
    long causal prefills without gradients in blocks of bfloat16 matmuls and hands every other call
    to SDPA. Nothing is done at ``"32-true"``, for an LM already in half precision, or for a model
    already held.

    Returns the number of linear layers cast. The LM's fingerprint is computed first, from the
    float32 weights, so payloads and exports keep naming the same LM.
    """
    import torch
    from torch import nn

    from .attention import ATTENTION_NAME, attention_forward
    from .compat import use_attention

    if resolve(precision, lm.device) == "32-true" or lm.dtype != torch.float32 or held_dtype(lm.model) is not None:
        return 0
    lm.fingerprint  # noqa: B018 -- cached from the float32 weights before any is cast
    model = lm.model
    cast = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
            module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().to(torch.bfloat16), requires_grad=False)
            cast += 1
    _own_float32_tensors(model)
    base = getattr(model, "base_model", None)
    for module in {id(m): m for m in (model, base) if isinstance(m, nn.Module)}.values():
        module.forward = _under_autocast(module)
    use_attention(model, ATTENTION_NAME, attention_forward)
    setattr(model, _HELD, torch.bfloat16)
    return cast


def _own_float32_tensors(model) -> None:
    """Give every float32 parameter and buffer left after the cast (the embedding table, the norms)
    memory of its own. A loader that maps the weights file keeps the whole mapping, the float32
    linear weights no forward reads any more among it, resident as long as one tensor of it
    lives: about 0.5 GB of SmolLM2's 0.54 GB file, held for nothing."""
    import torch
    from torch import nn

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.float32:
                setattr(module, name, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.dtype == torch.float32:
                module._buffers[name] = buffer.clone()


def _under_autocast(module):
    """``module.forward`` run under bfloat16 autocast on the device the module is on when called
    (a trainer may move it after it was held)."""
    import torch

    forward = module.forward

    @functools.wraps(forward)
    def held_forward(*args, **kwargs):
        device_type = module.get_input_embeddings().weight.device.type
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    return held_forward

"""The shared-weight view of an in-process vLLM engine: a transformers model object of the
checkpoint's class built on the meta device, whose embedding and norm parameters are the engine's
tensors and whose linear layers (`EngineLinear`) call the engine's own linear kernels. RCLC's
selection, prefill and reasoning run HF forwards through it (`ilcp.rclc.vllm.VLLMBackend`); it is
built once per engine (`shared_weight_view`) and fingerprinted from the checkpoint's files
(`view_weight_hash`).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
from pathlib import Path

import torch
from torch import nn

from ilcp.rclc.vllm_engine import check_engine, engine_model, llm_engine

__all__ = ["EngineLinear", "shared_weight_view", "view_weight_hash"]

_FUSED = {  # HF linear name -> (engine module name, index in its output_sizes)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class _EngineOutputs:
    """One engine linear layer, computed once per input and shared by the HF slices that read it
    (q/k/v read one fused qkv product, gate/up one gate_up product)."""

    def __init__(self, layer: nn.Module, parts: int) -> None:
        self.layer = layer
        self.parts = parts
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()
        sizes = getattr(layer, "output_sizes", None)
        if sizes is None:
            sizes = [int(getattr(layer, "output_size", 0) or layer.output_size_per_partition)]
        self.bounds = []
        start = 0
        for size in sizes:
            self.bounds.append((start, start + int(size)))
            start += int(size)
        self.out_features = start
        self.in_features = int(getattr(layer, "input_size", 0) or layer.input_size_per_partition)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        bias = getattr(layer, "bias", None)
        if getattr(layer, "skip_bias_add", False):
            bias = None
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        with torch.no_grad():
            y = layer.quant_method.apply(layer, flat, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.parts == 1:
            return self._compute(x)
        if self._input is not x or index in self._served:
            self._input, self._output, self._served = x, self._compute(x), set()
        self._served.add(index)
        start, stop = self.bounds[index]
        out = self._output[..., start:stop]
        if len(self._served) == self.parts:  # every slice read: drop the references
            self._input, self._output, self._served = None, None, set()
        return out


class EngineLinear(nn.Module):
    """An HF linear layer computed by the engine's (packed) linear kernel, output columns of one part."""

    def __init__(self, outputs: _EngineOutputs, index: int) -> None:
        super().__init__()
        self._outputs = outputs
        self.index = index
        start, stop = outputs.bounds[index] if outputs.parts > 1 else (0, outputs.out_features)
        self.in_features = outputs.in_features
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._outputs.part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, engine={type(self._outputs.layer).__name__}"


_VIEWS: "weakref.WeakKeyDictionary[object, nn.Module]" = weakref.WeakKeyDictionary()
_VIEW_LOCK = threading.Lock()


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _shared(param: torch.Tensor, shape: torch.Size, name: str) -> nn.Parameter:
    """``param`` (or its leading rows, for vLLM's padded vocabulary) as a Parameter on the same storage."""
    if tuple(param.shape) != tuple(shape):
        if param.dim() == len(shape) and param.shape[0] >= shape[0] and tuple(param.shape[1:]) == tuple(shape[1:]):
            param = param[: shape[0]]
        else:
            raise ValueError(f"the engine's {name} has shape {tuple(param.shape)}, the checkpoint's class expects "
                             f"{tuple(shape)}")
    shared = nn.Parameter(param.detach(), requires_grad=False)
    assert shared.data_ptr() == param.data_ptr()
    return shared


def _build_view(llm) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    engine = llm_engine(llm)
    served = engine_model(llm)
    directory = str(engine.model_config.model)
    dtype = engine.model_config.dtype
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        view = AutoModelForCausalLM.from_config(config, dtype=dtype)
    engine_modules = dict(served.named_modules())
    engine_params = dict(served.named_parameters(remove_duplicate=False))
    groups: dict[str, _EngineOutputs] = {}
    for name, module in list(view.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head":
            continue
        engine_leaf, index = _FUSED.get(leaf, (leaf, 0))
        engine_name = f"{prefix}.{engine_leaf}" if prefix else engine_leaf
        layer = engine_modules.get(engine_name)
        if layer is None or not hasattr(layer, "quant_method"):
            raise ValueError(f"the engine's model has no linear layer {engine_name!r} for the checkpoint's {name!r}")
        if engine_name not in groups:
            parts = len(getattr(layer, "output_sizes", None) or [1]) if leaf in _FUSED else 1
            groups[engine_name] = _EngineOutputs(layer, parts)
        adapter = EngineLinear(groups[engine_name], index if leaf in _FUSED else 0)
        if (adapter.in_features, adapter.out_features) != (module.in_features, module.out_features):
            raise ValueError(f"the engine's {engine_name!r} does not match the checkpoint's {name!r} "
                             f"({adapter.in_features}x{adapter.out_features} against "
                             f"{module.in_features}x{module.out_features})")
        _set_module(view, name, adapter)
    for name, param in list(view.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight":
            continue
        source = engine_params.get(name)
        if source is None:
            raise ValueError(f"the engine's model has no parameter {name!r}")
        module_name, _, attr = name.rpartition(".")
        setattr(view.get_submodule(module_name), attr, _shared(source, param.shape, name))
    if isinstance(getattr(view, "lm_head", None), nn.Linear):
        if getattr(config, "tie_word_embeddings", False):
            view.lm_head.weight = view.get_input_embeddings().weight
        else:
            view.lm_head.weight = _shared(engine_params["lm_head.weight"], view.lm_head.weight.shape, "lm_head.weight")
    device = view.get_input_embeddings().weight.device
    for name, module in list(view.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "inv_freq"):
                raise ValueError(f"the view's {name!r} holds buffers the engine does not provide")
            with torch.device(device):  # rotary frequencies, recomputed from the config as HF does at load
                _set_module(view, name, type(module)(config=config))
    left = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"the view could not take these tensors from the engine: {left}")
    view.eval()
    view.requires_grad_(False)
    view._rclc_engine = weakref.ref(llm)
    view._rclc_directory = directory
    view._rclc_weight_hash = None
    view._rclc_weight_digest = functools.partial(view_weight_hash, view)  # read by hf.weights_digest
    return view


def shared_weight_view(llm) -> nn.Module:
    """The HF-shaped model over ``llm``'s resident weights (built once per engine, then reused).

    Its embedding and norm parameters share storage with the engine's; its linear layers call the
    engine's linear kernels. It runs HF forwards (caches, eager attention, hidden states) for
    selection, prefill and reasoning; it cannot be trained or saved.

    Raises:
        TypeError / BackendUnavailableError / ValueError: as `VLLMBackend`.
    """
    check_engine(llm)
    with _VIEW_LOCK:
        try:
            view = _VIEWS.get(llm)
        except TypeError:
            view = getattr(llm, "_ilcp_rclc_view", None)
        if view is None:
            view = _build_view(llm)
            try:
                _VIEWS[llm] = view
            except TypeError:
                llm._ilcp_rclc_view = view
    return view


def view_weight_hash(view: nn.Module) -> str:
    """`ilcp.lm.weight_hash` of the checkpoint the engine serves, read tensor by tensor from its
    safetensors files in the served dtype (the view holds packed kernels, not tensors, so it cannot
    be hashed directly). Equal to the hash of the same checkpoint loaded with transformers; cached."""
    if view._rclc_weight_hash is not None:
        return view._rclc_weight_hash
    from safetensors import safe_open

    directory = Path(view._rclc_directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no safetensors files to fingerprint the served weights")
    dtype = view.get_input_embeddings().weight.dtype
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                where[key] = f
    names = sorted(n for n in where if not n.endswith("inv_freq"))
    h = hashlib.sha256()
    from ilcp.lm import tensor_bytes

    for name in names:
        with safe_open(str(where[name]), framework="pt") as handle:
            t = handle.get_tensor(name).to(dtype)
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(tensor_bytes(t))
    view._rclc_weight_hash = h.hexdigest()
    return view._rclc_weight_hash


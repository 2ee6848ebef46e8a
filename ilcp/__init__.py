"""ilcp: hand an LLM agent's context to another agent in latent form instead of text.

Two paths, measured against the text handoff on the same tasks:
- ILCP: pooled hidden state -> beta-VAE latent (32 floats) -> gated-MLP soft prompt.
- RCLC (`ilcp.rclc`): a budgeted selection of the sender's input-embedding rows.

    from ilcp import ILCPHandoff, load_lm, rclc

    lm = load_lm()                                              # the embedded SmolLM2
    handoff = ILCPHandoff.from_pretrained("checkpoints/default", lm=lm)
    memory = handoff.open(handoff.send("Mary moved to the hallway.").to_bytes())
    memory.ask(["Where is Mary?", "Who moved?"])

The names below are loaded on first use, so ``import ilcp`` itself loads neither torch nor
Lightning nor vLLM.
"""

import importlib

__version__ = "0.1.0"

# name -> (module, attribute in it; None for the module itself)
_PUBLIC = {
    "ILCPHandoff": ("ilcp.handoff", "ILCPHandoff"),
    "LM": ("ilcp.lm", "LM"),
    "PayloadError": ("ilcp.wire.errors", "PayloadError"),
    "ReceivedMemory": ("ilcp.receiver.memory", "ReceivedMemory"),
    "load_lm": ("ilcp.lm", "load_lm"),
    "rclc": ("ilcp.rclc", None),
    "receiver_framing": ("ilcp.receiver.rclc_prompts", "receiver_framing"),  # the text handoff's prompt for RCLC rows
}

__all__ = sorted(["__version__", *_PUBLIC])


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ilcp' has no attribute {name!r}")
    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))

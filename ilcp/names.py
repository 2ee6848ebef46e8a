"""The names and defaults that configs and command lines check before any model code loads.

This module imports only the standard library, so ``ilcp-train --help`` and a mistyped key answer without torch.
The modules that use these names import them from here; where a module that imports torch
builds its own list (the evaluation registry's methods and groups, `ilcp.transport`'s dtypes),
tests/test_cli_startup.py checks that the two are equal.
"""

from difflib import get_close_matches

# the frozen LM (ilcp.lm)
DEFAULT_LM = "smollm2-135m-instruct"

# compute precision (ilcp.precision)
PRECISIONS = ("32-true", "bf16-mixed", "auto")

# the ILCP memory source (ilcp.encoder)
POOLING_KINDS = ("mean", "attention", "concat")
VOCABULARY_SNAPS = ("none", "soft", "hard")
SNAP_METRICS = ("cosine", "dot")  # how a snap scores the embedding rows (and the token loss its logits)

# evaluation methods (ilcp.evaluation.registry, as ilcp.evaluation registers them)
METHODS = ("cold_read", "cold_read_tuned", "ilcp", "no_context", "prompt_tuned")  # exact names, sorted
METHOD_FAMILIES = ("kv_relay", "rclc")  # "family:..." names, each parsed by its family
METHOD_GROUPS = ("default", "rclc", "rclc-quick", "rclc-budgets", "rclc-budgets-tuned")
DEFAULT_METHODS = ("no_context", "prompt_tuned", "cold_read", "cold_read_tuned", "ilcp")

# ilcp-eval's defaults (ilcp.evaluation.run, ilcp.evaluation.decoders, ilcp.transport)
DEFAULT_LIMIT = 200
DEFAULT_LATENCY_N = 20
DEFAULT_LENGTHS = (64, 256, 1024, 2048)
DEFAULT_FACTS_COUNTS = (1, 2, 4, 8, 16)
DEFAULT_THROUGHPUT_N = 64
ENGINES = ("hf", "vllm")
PAYLOAD_DTYPES = ("float32", "float16", "bfloat16", "int8")


def method_names() -> list[str]:
    """The built-in method names as `ilcp.evaluation.method_names` lists them: exact names, then
    ``"family:..."``."""
    return list(METHODS) + [f"{family}:..." for family in METHOD_FAMILIES]


def unknown_method(name: str) -> str | None:
    """Why `name` is neither a built-in method, a group, nor a name of a built-in family (whose
    own parser checks the rest when the method is made), with the closest valid name when one is
    close; None when it is one of those."""
    name = name.strip()
    family, colon, rest = name.partition(":")
    if (not colon and name in METHODS + METHOD_GROUPS) or (colon and family in METHOD_FAMILIES):
        return None
    if colon:
        close = [f"{f}:{rest}" for f in get_close_matches(family, METHOD_FAMILIES, n=1)]
    else:
        close = get_close_matches(name, METHODS + METHOD_GROUPS, n=1)
    if close:
        return f"unknown method {name!r}; did you mean {close[0]!r}?"
    return f"unknown method {name!r}; known: {', '.join(method_names())}; groups: {', '.join(METHOD_GROUPS)}"

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

# task names (ilcp.tasks): each source's name pattern (a regex, full match, case-insensitive) and
# the forms it accepts, in the order the registry tries them; each source registers its loader
# under its key here (`ilcp.tasks.register_task`)
TASK_NAMES = {
    "babi": (r"babi[-:_](?:qa)?\d+(?:\+(?:babi[-:_]?)?(?:qa)?\d+)*|qa\d+|babi[-:_]all",
             "'babi:N' (a bAbI task number; also 'babi-qaN'), a mix 'babi:1+2+3', 'babi:all' (every shipped task)"),
    "facts": (r"facts(?:-heldout)?", "'facts', 'facts-heldout' (eval: values never seen in training)"),
    "babilong": (r"babilong(?:[:_-].*)?", "'babilong:N:LENGTH' (bAbI task N in LENGTH tokens of prose: 0, 0.5k, 1k, 2k, "
                                    "4k or a number; a mix 'babilong:1+7+8:0.5k')"),
    "squad": (r"squad", "'squad' (the shipped SQuAD v1.1 subset, open-text answers)"),
    "files": (r"(?:jsonl|csv|parquet|disk):.+", "a file of your own: 'jsonl:PATH', 'csv:PATH', 'parquet:PATH', "
                                               "'disk:PATH' (a datasets folder), or one file per split "
                                               "'jsonl:train=A,test=B'"),
}


def task_source(name: str) -> str | None:
    """The source whose pattern a task name matches (None for none)."""
    import re

    text = name.strip() if isinstance(name, str) else ""
    for source, (pattern, _) in TASK_NAMES.items():
        if re.fullmatch(pattern, text, re.IGNORECASE | re.DOTALL):
            return source
    return None


def split_task_names(text: str) -> list[str]:
    """Task names from a comma-separated list. A file task with one file per split keeps its commas:
    "babi:2,jsonl:train=a.jsonl,test=b.jsonl" is ["babi:2", "jsonl:train=a.jsonl,test=b.jsonl"]."""
    import re

    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if names and re.match(r"(train|validation|test)=", part) and task_source(names[-1]) == "files":
            names[-1] += "," + part
        else:
            names.append(part)
    return names


def unknown_task(name) -> str | None:
    """Why ``name`` is no task name of any source (None when a source's pattern matches; the
    source's own parser checks the rest when the task is resolved)."""
    if not isinstance(name, str) or not name.strip():
        return f"a task name must be a non-empty string, got {name!r}"
    if task_source(name) is not None:
        return None
    forms = "; ".join(forms for _, forms in TASK_NAMES.values())
    return f"unknown task {name!r}; available: {forms}"


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

"""The names and defaults that configs and command lines check before any model code loads.

This module imports only the standard library, so ``ilcp-train --help`` and a mistyped key answer without torch.
The modules that use these names import them from here; where a module that imports torch
builds its own list (`ilcp.wire.payload`'s dtypes), tests/test_cli_startup.py checks that the two are equal.

Each kind of name with an implementation behind it has one registry here, the only list of its
names: RCLC selectors (`SELECTORS`), evaluation methods, families and groups (`METHODS`,
`METHOD_FAMILIES`, `METHOD_GROUPS`) and memory kinds (`MEMORY_KINDS`); task names have
`TASK_NAMES`, and a BABILong task's name is parsed here (`parse_babilong_name`). An entry names
its implementation as ``"module:attribute"``, imported only when the name is used (`resolve`), so
the command lines' help, the config checks and the torch-side registries all derive from the same
table: a new selector, method or memory kind is its module and one entry. tests/test_name_registries.py fails when a list of a kind's names is spelled
anywhere else under ilcp/.
"""

import re
from difflib import get_close_matches
from typing import NamedTuple


def resolve(target: str):
    """The object a registry entry names, ``"package.module:attribute"``, importing its module."""
    from importlib import import_module

    module, _, attribute = target.partition(":")
    return getattr(import_module(module), attribute)


class Registered(NamedTuple):
    """One entry of a registry: its implementation (``"module:attribute"``) and its help line."""

    target: str
    help: str


# the frozen LM (ilcp.lm)
DEFAULT_LM = "smollm2-135m-instruct"

# compute precision (ilcp.precision)
PRECISIONS = ("32-true", "bf16-mixed", "auto")

# the ILCP memory source (ilcp.encoder.model): the memory kinds, each a settings dataclass
# (`ilcp.encoder.kinds.MemoryKind`) whose name is the training config's ``compressor.memory.kind``
# and config.json's ``pooling.kind``
MEMORY_KINDS = {
    "mean": Registered("ilcp.encoder.kinds:MeanMemory", "the masked mean of the token states (the spec), per context "
                                                         "or per chunk"),
    "attention": Registered("ilcp.encoder.kinds:AttentionMemory", "learned attention queries over the token states, "
                                                                  "per context or per chunk"),
    "concat": Registered("ilcp.encoder.kinds:CodecMemory", "the token codec: a chunk's token states side by side"),
    "slots": Registered("ilcp.encoder.slot_memory:SlotMemory", "learned tokens the sender's LM reads after the "
                                                               "context, one latent each"),
    "chunk": Registered("ilcp.encoder.chunk_memory:ChunkMemory", "one vector per chunk of tokens, written by one "
                                                                "shared MLP and read as it is"),
}


# where the receiver reads the memory vectors (ilcp.receiver.prompts.memory_prompt): read by the
# sender's encoder, the export spec and the receiver alike
MEMORY_PLACEMENTS = ("prefix", "in_prompt")

VOCABULARY_SNAPS = ("none", "soft", "hard")
SNAP_METRICS = ("cosine", "dot")  # how a snap scores the embedding rows (and the token loss its logits)

# RCLC selectors: ilcp.rclc.selectors builds one ready-made instance of each class (its default
# settings) under its name, in this order; ``rclc:<selector>:...`` rows and
# ``handoff.selection_selector`` take these names
SELECTORS = {
    "cacheback": Registered("ilcp.rclc.selectors.cacheback:CacheBack",
                            "the default: the request's attention and the sender's look-back attention, in spans"),
    "qsnap": Registered("ilcp.rclc.selectors.qsnap:QSnap", "SnapKV with the request as the observation window"),
    "chunkkv": Registered("ilcp.rclc.selectors.chunkkv:ChunkKV", "whole fixed chunks, by the request's attention"),
    "sentences": Registered("ilcp.rclc.selectors.sentences:Sentences", "whole sentences, by the request's attention"),
    "reread": Registered("ilcp.rclc.selectors.reread:Reread",
                         "the attention the sender pays reading its context again, whatever the request"),
    "overlap": Registered("ilcp.rclc.selectors.overlap:Overlap",
                          "whole sentences, by the tokens they share with the request"),
}
DEFAULT_SELECTOR = "cacheback"

# evaluation methods: `ilcp.evaluation.registry` answers each exact name with its class, built
# with the name; each "family:..." name with its family's factory, called with the whole name
# (which it parses); each group with its tuple of method names
METHODS = {
    "cold_read": Registered("ilcp.evaluation.methods:ColdRead", "the whole context text + the question, zero-shot"),
    "cold_read_tuned": Registered("ilcp.evaluation.methods:ColdReadTuned",
                                  "K trained vectors + the context text + the question"),
    "ilcp": Registered("ilcp.evaluation.methods:ILCPMethod",
                       "K memory vectors projected from the received latent + the question"),
    "no_context": Registered("ilcp.evaluation.methods:NoContext", "the question alone, zero-shot"),
    "prompt_tuned": Registered("ilcp.evaluation.methods:PromptTuned", "K trained vectors + the question, no transfer"),
}
METHOD_FAMILIES = {
    "kv_relay": Registered("ilcp.evaluation.kv_relay:KVRelayMethod",
                           "the KV cache entries of the positions a selector keeps: kv_relay:SELECTOR:rN or :bN "
                           "[:prefix]"),
    "rclc": Registered("ilcp.evaluation.rclc_methods:RCLCMethod",
                       "the input-embedding rows a selector keeps: the RCLC rows below"),
}
DEFAULT_METHODS = ("no_context", "prompt_tuned", "cold_read", "cold_read_tuned", "ilcp")
METHOD_GROUPS = {
    "default": Registered("ilcp.names:DEFAULT_METHODS", "what runs when --methods is not given"),
    "rclc": Registered("ilcp.evaluation.rclc_methods:RCLC_METHODS",
                       "cacheback r1; every selector at r4, r16 and b16; cacheback r4:prefix and r4:tuned"),
    "rclc-quick": Registered("ilcp.evaluation.rclc_methods:RCLC_QUICK", "cacheback r1, r4 and r4:tuned"),
    "rclc-budgets": Registered("ilcp.evaluation.rclc_methods:RCLC_BUDGETS",
                               "every selector at r16, r8, r4, r2, b16 and b32, and r1; plotted as "
                               "selection_budgets.png"),
    "rclc-budgets-tuned": Registered("ilcp.evaluation.rclc_methods:RCLC_BUDGETS_TUNED", "the same, :tuned"),
}

# task names (ilcp.tasks): each source's name pattern (a regex, full match, case-insensitive) and
# the forms it accepts, in the order the registry tries them; each source registers its loader
# under its key here (`ilcp.tasks.register_task`)
TASK_NAMES = {
    "mix": (r"mix:.+", "a mix of any tasks 'mix:squad|babi:all' (balanced, reported task by task)"),
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
    "babi:2,jsonl:train=a.jsonl,test=b.jsonl" is ["babi:2", "jsonl:train=a.jsonl,test=b.jsonl"]; so
    does a file task's path: after a file task, a part that is no task name continues it
    ("jsonl:my,notes.jsonl" is one task)."""
    import re

    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if names and task_source(names[-1]) == "files" and (re.match(r"(train|validation|test)=", part)
                                                             or task_source(part) is None):
            names[-1] += "," + part  # a per-split file, or the rest of a path that holds a comma
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
    bare = name.strip().rstrip(":")
    if name.strip().endswith(":") and bare in ("jsonl", "csv", "parquet", "disk"):
        return f"task {name!r} names no file: give its path, e.g. {bare}:data/rows{'' if bare == 'disk' else '.' + bare}"
    forms = "; ".join(forms for _, forms in TASK_NAMES.values())
    return f"unknown task {name!r}; available: {forms}"


# BABILong task names (ilcp.tasks.babilong): ``babilong:<task>:<length>``, parsed here so configs and
# command lines check them before the task code loads
TOKENS_PER_K = 1024
NAMED_LENGTHS = ("0", "0.5k", "1k", "2k", "4k")
_NAME = re.compile(r"babilong[:_-]((?:qa)?\d+(?:\+(?:qa)?\d+)*)(?:[:_-](.*))?\Z", re.IGNORECASE | re.DOTALL)
_LENGTH = re.compile(r"(\d+(?:\.\d+)?)(k?)\Z", re.IGNORECASE)


class BabilongTask(NamedTuple):
    """A parsed task name: bAbI task ``number``, ``length`` in tokens, canonical ``name``
    (``"babilong-qa1-2k"``, also the rows' ``task`` column). A mix (``"babilong:1+8:0.5k"``,
    canonical ``"babilong-qa1+qa8-0.5k"``) lists its tasks in ``numbers``, sorted, ``number``
    being the first; a single task's ``numbers`` is ``(number,)``."""

    number: int
    length: int
    name: str
    numbers: tuple[int, ...] = ()

    @property
    def parts(self) -> list[str]:
        """The single-task names of a mix (``["babilong:1:0.5k", "babilong:8:0.5k"]``), or this task's."""
        return [f"babilong:{n}:{length_label(self.length)}" for n in (self.numbers or (self.number,))]


def is_babilong_name(name) -> bool:
    """Whether ``name`` is meant as a BABILong task ("babilong:..."), well-formed or not."""
    return isinstance(name, str) and name.strip().lower().startswith("babilong")


def parse_length(text: str | int) -> int:
    """Tokens of a length: ``"0"``, ``"0.5k"``, ``"1k"``, ``"2k"``, ``"4k"`` (k = 1024), any
    ``"<x>k"`` that is a whole number of tokens, a plain number (``"1500"``) or an int >= 0."""
    if isinstance(text, int) and not isinstance(text, bool):
        tokens = text
    else:
        match = _LENGTH.match(str(text).strip())
        if match is None:
            raise ValueError(f"unknown length {text!r}: use {', '.join(NAMED_LENGTHS)} "
                             "(k = 1024 tokens) or a number of tokens such as 1500")
        value = float(match.group(1)) * (TOKENS_PER_K if match.group(2) else 1)
        if value != int(value):
            raise ValueError(f"length {text!r} is not a whole number of tokens (k = 1024)")
        tokens = int(value)
    if tokens < 0:
        raise ValueError(f"a length must be >= 0 tokens, got {text!r}")
    return tokens


def length_label(tokens: int) -> str:
    """``"0"``, ``"0.5k"``, ``"1k"``, ``"1.5k"``... for multiples of 512 tokens, else the number."""
    if tokens > 0 and tokens % (TOKENS_PER_K // 2) == 0:
        return f"{tokens / TOKENS_PER_K:g}k"
    return str(tokens)


def parse_babilong_name(name: str) -> BabilongTask:
    """``"babilong:<task>:<length>"`` (also ``babilong:qa1:2k``, or a mix ``babilong:1+8:0.5k``)
    as a `BabilongTask`; ValueError naming what is wrong. Does not look for the bAbI file
    (`ilcp.tasks.load_babilong` does)."""
    if not isinstance(name, str):
        raise ValueError(f"a BABILong task name is a string, got {name!r}")
    match = _NAME.match(name.strip())
    if match is None:
        raise ValueError(f"unknown BABILong task {name!r}: use 'babilong:<task>:<length>', e.g. "
                         f"'babilong:1:2k' (lengths: {', '.join(NAMED_LENGTHS)} or a number of tokens)")
    numbers = [int(part.lower().removeprefix("qa")) for part in match.group(1).split("+")]
    length, tasks = match.group(2), match.group(1)
    if min(numbers) < 1:
        raise ValueError(f"BABILong task {name!r}: the bAbI task number must be >= 1")
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"BABILong task {name!r}: a bAbI task is listed twice")
    if not length:
        raise ValueError(f"BABILong task {name!r} needs a length: 'babilong:{tasks}:<length>', e.g. "
                         f"'babilong:{tasks}:2k' (lengths: {', '.join(NAMED_LENGTHS)} or a number of "
                         "tokens)")
    try:
        tokens = parse_length(length)
    except ValueError as e:
        raise ValueError(f"BABILong task {name!r}: {e}") from None
    numbers = sorted(numbers)
    canonical = "babilong-" + "+".join(f"qa{n}" for n in numbers) + f"-{length_label(tokens)}"
    return BabilongTask(numbers[0], tokens, canonical, tuple(numbers))


# ilcp-eval's defaults (ilcp.evaluation.run, ilcp.evaluation.decoders, ilcp.wire.payload)
DEFAULT_LIMIT = 200
DEFAULT_LATENCY_N = 20
DEFAULT_LENGTHS = (64, 256, 1024, 2048)
DEFAULT_FACTS_COUNTS = (1, 2, 4, 8, 16)
DEFAULT_THROUGHPUT_N = 64
ENGINES = ("hf", "vllm")
EVAL_SPLITS = ("test", "validation")  # whose questions eval asks
PAYLOAD_DTYPES = ("float32", "float16", "bfloat16", "int8")


def method_names() -> list[str]:
    """The built-in method names as `ilcp.evaluation.method_names` lists them: exact names, then
    ``"family:..."``, each sorted."""
    return sorted(METHODS) + [f"{family}:..." for family in sorted(METHOD_FAMILIES)]


def unknown_method(name: str) -> str | None:
    """Why `name` is neither a built-in method, a group, nor a name of a built-in family (whose
    own parser checks the rest when the method is made), with the closest valid name when one is
    close; None when it is one of those."""
    name = name.strip()
    family, colon, rest = name.partition(":")
    if (not colon and (name in METHODS or name in METHOD_GROUPS)) or (colon and family in METHOD_FAMILIES):
        return None
    if colon:
        close = [f"{f}:{rest}" for f in get_close_matches(family, list(METHOD_FAMILIES), n=1)]
    else:
        close = get_close_matches(name, [*METHODS, *METHOD_GROUPS], n=1)
    if close:
        return f"unknown method {name!r}; did you mean {close[0]!r}?"
    return f"unknown method {name!r}; known: {', '.join(method_names())}; groups: {', '.join(METHOD_GROUPS)}"

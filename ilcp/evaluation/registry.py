"""What a handoff method is, and the registry that names methods and groups of methods.

A method is one row of the evaluation's results table: what the sender
hands over and what the receiver prefills before it answers. Every method turns task rows
``{context, question, answer}`` into receiver prefixes, (L, H) tensors in the frozen LM's
embedding space, which one greedy decoder answers. Each method has two paths:

- `HandoffMethod.build_prefixes(rows)`: the batched path for accuracy (prefixes plus the bytes
  each row sent);
- `HandoffMethod.send(row)` then `HandoffMethod.receive(sent, row)`: one request, sender side
  and receiver side apart, so latency can time each.

A method whose receiver starts from something other than an embedding prefix (a KV cache relay,
`ilcp.evaluation.kv_relay`) sets ``decodes_itself = True`` and decodes itself: `decode_rows`
replaces ``build_prefixes`` + the shared greedy decoder on the accuracy path, and
`decode_received` replaces the shared ``decode_one`` on the timed path (``receive`` then returns
whatever that decoder starts from). Every other method goes through the shared decoder.

The built-in names are the registries of `ilcp.names` (`METHODS`, `METHOD_FAMILIES`,
`METHOD_GROUPS`), which the command lines check before torch loads; this module answers each
with the class, factory or tuple its entry names, importing that module when the name is first
used: `ilcp.evaluation.methods` (the built-in methods), `ilcp.evaluation.rclc_methods` (the
``rclc:...`` family and its groups), `ilcp.evaluation.kv_relay` (``kv_relay:...``). A built-in
method, family or group is one entry there. A family of your own registers a factory for a name
prefix at run time, so its names need no change to the evaluation loop:

    from ilcp.evaluation.registry import HandoffMethod, register_method

    class MyMethod(HandoffMethod):
        ...
    register_method("mine", lambda name: MyMethod(name), family=True)   # "mine:<anything>"

Groups name lists of methods; `expand_method_names` replaces them by their members.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from ..receiver.decoding import DecodeResult
from ..export import ExportedRun
from ..handoff import ILCPHandoff
from ..lm import LM
from ..names import METHOD_FAMILIES, METHOD_GROUPS, METHODS, resolve

__all__ = [
    "Decoded",
    "EvalContext",
    "HandoffMethod",
    "MethodUnavailable",
    "Prefixes",
    "Sent",
    "expand_method_names",
    "make_method",
    "method_groups",
    "method_names",
    "register_group",
    "register_method",
]


class MethodUnavailable(Exception):
    """The method cannot run for this run (e.g. its trained weights are missing); the message
    says why. The evaluation skips it with a note."""


@dataclass(frozen=True)
class Sent:
    """What one request's sender handed over.

    Attributes:
        handed_over: what crosses the handoff: bytes (an ILCP payload, utf-8 text), an
            `ilcp.rclc.Delivery` (selected rows), or None (nothing).
        wire_bytes: bytes on the wire.
        tensor_bytes: bytes of the tensors inside what was handed over (the article's payload
            figure); 0 for methods that send no tensor.
    """

    handed_over: object
    wire_bytes: int
    tensor_bytes: int = 0


@dataclass
class Prefixes:
    """A batch of receiver prefixes: ``prefixes[i]`` is (L_i, H); the bytes row i sent."""

    prefixes: list[Tensor]
    wire_bytes: list[int]
    tensor_bytes: list[int]

    def __post_init__(self):
        if not len(self.prefixes) == len(self.wire_bytes) == len(self.tensor_bytes):
            raise ValueError("prefixes, wire_bytes and tensor_bytes must have one entry per row")


@dataclass
class Decoded:
    """A batch of answers from a method that decodes itself (`HandoffMethod.decode_rows`).

    Attributes:
        answers: one answer per row, as the shared greedy decoder returns them.
        wire_bytes, tensor_bytes: what each row's sender handed over.
        prefill_positions: the positions each row's first answer token attends to.
        decode_s: seconds of receiver decoding (the sender's work excluded).
    """

    answers: list[str]
    wire_bytes: list[int]
    tensor_bytes: list[int]
    prefill_positions: list[int]
    decode_s: float = 0.0

    def __post_init__(self):
        if not len(self.answers) == len(self.wire_bytes) == len(self.tensor_bytes) == len(self.prefill_positions):
            raise ValueError("answers, wire_bytes, tensor_bytes and prefill_positions must have one entry per row")


@dataclass
class EvalContext:
    """What methods may use: the frozen LM, the run's trained modules and the ILCP handoff.

    Attributes:
        lm: the frozen LM (sender and receiver run the same one).
        run: the run's exported modules (``run.soft_prompts`` holds the tuned baselines' (K, H)).
        handoff: the ILCP handoff, or None when the run has no ILCP weights.
        pool_batch_size: contexts per pooling forward on the batched path.
        max_new_tokens: the answer token budget the receiver decodes with (receivers that
            reserve output positions read it); None when unknown.
        extras: anything a registered method family needs (free-form).
    """

    lm: LM
    run: ExportedRun
    handoff: ILCPHandoff | None = None
    pool_batch_size: int = 16
    max_new_tokens: int | None = None
    extras: dict = field(default_factory=dict)


class HandoffMethod:
    """Base class of a method. Subclasses set `name` and implement `send` and `receive`.

    Attributes:
        name: the name eval.py reports (and that `make_method` resolves).
        requires: export entries (``config.json["files"]`` keys) the method needs.
        carries_context: whether anything of the context reaches the receiver.
        vllm_unavailable: why the method's receiver cannot decode through vLLM
            (``eval.py --engine vllm`` reports it instead), or None: it can (its prefixes are
            ``prompt_embeds``; prefixes longer than the engine's context are refused apart).
        decodes_itself: the receiver does not start from an (L, H) prefix; the evaluation calls
            `decode_rows` and `decode_received` instead of the shared greedy decoder.
        shares_sender_states: the accuracy path builds each context's sender state through the
            evaluation's shared `SenderStates` (``sender_text(context)`` names it), so the
            evaluation runs such methods together, chunk by chunk of questions.
    """

    name: str = ""
    requires: tuple[str, ...] = ()
    carries_context: bool = True
    vllm_unavailable: str | None = None
    decodes_itself: bool = False
    shares_sender_states: bool = False

    def __init__(self, name: str | None = None):
        if name is not None:
            self.name = name
        self.ctx: EvalContext | None = None

    def bind(self, ctx: EvalContext) -> None:
        """Attach the run's LM and modules; raise `MethodUnavailable` if the run lacks them."""
        files = ctx.run.config.get("files", {})
        missing = [r for r in self.requires if r not in files]
        if missing:
            raise MethodUnavailable(f"{self.name}: the run has no {', '.join(missing)} weights")
        self.ctx = ctx

    @property
    def lm(self) -> LM:
        if self.ctx is None:
            raise RuntimeError(f"method {self.name!r} is not bound to a run: call bind(ctx) first")
        return self.ctx.lm

    def send(self, row: dict) -> Sent:
        """Sender-side work for one row (timed as sender time)."""
        raise NotImplementedError

    def receive(self, sent: Sent, row: dict) -> Tensor:
        """Receiver-side work up to its prefix (L, H) (timed as part of time to first token)."""
        raise NotImplementedError

    def build_prefixes(self, rows: Sequence[dict]) -> Prefixes:
        """Prefixes for many rows (the accuracy path). The default runs `send` and `receive`
        row by row; methods with batched sender work override it."""
        sent = [self.send(r) for r in rows]
        return Prefixes(
            prefixes=[self.receive(s, r) for s, r in zip(sent, rows)],
            wire_bytes=[s.wire_bytes for s in sent],
            tensor_bytes=[s.tensor_bytes for s in sent],
        )

    def decode_rows(self, rows: Sequence[dict], *, max_new_tokens: int, stop_at_newline: bool = True) -> Decoded:
        """The accuracy path of a method that decodes itself: answers for many rows, greedy, with
        the shared decoder's stop rule. Only called when ``decodes_itself``."""
        raise NotImplementedError(f"{self.name} decodes through the shared greedy decoder")

    def decode_received(self, received, row: dict, *, max_new_tokens: int,
                        stop_at_newline: bool = True) -> DecodeResult:
        """The timed receiver of a method that decodes itself: decode from what `receive`
        returned, timed as `ilcp.receiver.decoding.decode_one` times a prefix. Only called when
        ``decodes_itself``."""
        raise NotImplementedError(f"{self.name} decodes through the shared greedy decoder")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _factory(target: str) -> Callable[[str], HandoffMethod]:
    """``factory(name)`` for the class or factory an `ilcp.names` entry names, imported when first called."""
    return lambda name: resolve(target)(name)


def _members(target: str) -> Callable[[], tuple[str, ...]]:
    """``members()`` for the tuple of method names an `ilcp.names` entry names, imported when first called."""
    return lambda: tuple(resolve(target))


# the built-in names, from the registries of ilcp.names; register_method and register_group add others
_EXACT: dict[str, Callable[[str], HandoffMethod]] = {name: _factory(e.target) for name, e in METHODS.items()}
FAMILIES: dict[str, Callable[[str], HandoffMethod]] = {name: _factory(e.target) for name, e in METHOD_FAMILIES.items()}
_GROUPS: dict[str, Callable[[], tuple[str, ...]]] = {name: _members(e.target) for name, e in METHOD_GROUPS.items()}


def register_method(name: str, factory: Callable[[str], HandoffMethod], *, family: bool = False,
                    replace: bool = False) -> None:
    """Make ``factory(full_name)`` answer for a method name.

    Args:
        name: an exact method name, or with ``family=True`` a prefix: the factory then answers
            every ``"{name}:..."`` name and parses the rest itself (raising ValueError for a bad one).
        factory: called with the full name; returns a new, unbound method.
        replace: allow replacing an existing registration.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"method name must be a non-empty string without ':', got {name!r}")
    if not callable(factory):
        raise ValueError(f"factory for {name!r} must be callable, got {factory!r}")
    table = FAMILIES if family else _EXACT
    if name in table and not replace:
        raise ValueError(f"method {name!r} is already registered (pass replace=True to replace it)")
    table[name] = factory


def method_names() -> list[str]:
    """Registered exact names, then families as ``"family:..."``."""
    return sorted(_EXACT) + [f"{f}:..." for f in sorted(FAMILIES)]


def make_method(name: str) -> HandoffMethod:
    """A new, unbound method for a name. Raises ValueError for an unknown name."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"method name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in _EXACT:
        return _EXACT[name](name)
    family = name.split(":", 1)[0]
    if ":" in name and family in FAMILIES:
        return FAMILIES[family](name)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(method_names())}")


def register_group(name: str, names: Sequence[str], *, replace: bool = False) -> None:
    """Make ``name`` stand for a list of method names in `expand_method_names`.

    Raises:
        ValueError: a name with ':' or already taken (without ``replace``), or an empty list.
    """
    if not isinstance(name, str) or not name or ":" in name or name in _EXACT:
        raise ValueError(f"group name must be a non-empty string without ':' and not a method name, got {name!r}")
    if name in _GROUPS and not replace:
        raise ValueError(f"group {name!r} is already registered (pass replace=True to replace it)")
    if isinstance(names, str) or not names:
        raise ValueError(f"group {name!r} needs a non-empty list of method names")
    members = tuple(names)
    _GROUPS[name] = lambda: members


def method_groups() -> dict[str, tuple[str, ...]]:
    """Registered groups and their method names."""
    return {name: members() for name, members in _GROUPS.items()}


def expand_method_names(names: Sequence[str]) -> list[str]:
    """Method names with every group replaced by its members, first occurrence kept, in order."""
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"method name must be a non-empty string, got {name!r}")
        group = _GROUPS.get(name.strip())
        out += group() if group is not None else (name.strip(),)
    return list(dict.fromkeys(out))

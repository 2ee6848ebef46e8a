"""The handoff methods eval.py compares, and the registry that names them.

A method is one row of the protocol table (see shared/design/ARCHITECTURE.md): what the sender
hands over and what the receiver prefills before it answers. Every method turns task rows
``{context, question, answer}`` into receiver prefixes, (L, H) tensors in the frozen LM's
embedding space, which one greedy decoder answers. Each method has two paths:

- `HandoffMethod.build_prefixes(rows)`: the batched path for accuracy (prefixes plus the bytes
  each row sent);
- `HandoffMethod.send(row)` then `HandoffMethod.receive(sent, row)`: one request, sender side
  and receiver side apart, so latency can time each.

Built-in methods: ``no_context``, ``prompt_tuned``, ``cold_read``, ``cold_read_tuned``, ``ilcp``,
and the ``rclc:...`` family (`ilcp.evaluation.rclc_methods`). Other families register a factory
for a name prefix, so their names need no change to the evaluation loop:

    from ilcp.evaluation.methods import HandoffMethod, register_method

    class MyMethod(HandoffMethod):
        ...
    register_method("mine", lambda name: MyMethod(name), family=True)   # "mine:<anything>"

Groups name lists of methods (``default``: `DEFAULT_METHODS`; ``rclc`` and ``rclc-quick``: RCLC
rows); `expand_method_names` replaces them by their members.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from ..decoding import assemble_prefix
from ..export import ExportedRun
from ..handoff import ILCPHandoff
from ..lm import LM
from ..prompts import cold_read_prompt, question_prompt

__all__ = [
    "DEFAULT_METHODS",
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

DEFAULT_METHODS = ("no_context", "prompt_tuned", "cold_read", "cold_read_tuned", "ilcp")


class MethodUnavailable(Exception):
    """The method cannot run for this run (e.g. its trained weights are missing); the message
    says why. The evaluation skips it with a note."""


@dataclass(frozen=True)
class Sent:
    """What one request's sender handed over.

    Attributes:
        message: what crosses the handoff: bytes (a payload, utf-8 text) or None (nothing).
        wire_bytes: bytes on the wire.
        tensor_bytes: bytes of the tensors inside the payload (the article's payload figure); 0
            for methods that send no tensor.
    """

    message: object
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
class EvalContext:
    """What methods may use: the frozen LM, the run's trained modules and the ILCP handoff.

    Attributes:
        lm: the frozen LM (sender and receiver run the same one).
        run: the run's exported modules (``run.soft_prompts`` holds the tuned baselines' (K, H)).
        handoff: the ILCP handoff, or None when the run has no ILCP weights.
        pool_batch_size: contexts per pooling forward on the batched path.
        extras: anything a registered method family needs (free-form).
    """

    lm: LM
    run: ExportedRun
    handoff: ILCPHandoff | None = None
    pool_batch_size: int = 16
    extras: dict = field(default_factory=dict)


class HandoffMethod:
    """Base class of a method. Subclasses set `name` and implement `send` and `receive`.

    Attributes:
        name: the name eval.py reports (and that `make_method` resolves).
        requires: export entries (``config.json["files"]`` keys) the method needs.
        carries_context: whether anything of the context reaches the receiver.
    """

    name: str = ""
    requires: tuple[str, ...] = ()
    carries_context: bool = True

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

    def _prefix(self, parts: list) -> Tensor:
        return assemble_prefix(self.lm.model, self.lm.tokenizer, parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# --------------------------------------------------------------------------------------------
# built-in methods


class NoContext(HandoffMethod):
    """The question alone, zero-shot: the floor."""

    name = "no_context"
    carries_context = False

    def send(self, row: dict) -> Sent:
        return Sent(message=None, wire_bytes=0)

    def receive(self, sent: Sent, row: dict) -> Tensor:
        return self._prefix([question_prompt(self.lm.tokenizer, row["question"])])


class PromptTuned(HandoffMethod):
    """K trained constant vectors + the question: what training alone buys (no transfer)."""

    name = "prompt_tuned"
    requires = ("prompt_tuned",)
    carries_context = False

    def send(self, row: dict) -> Sent:
        return Sent(message=None, wire_bytes=0)

    def receive(self, sent: Sent, row: dict) -> Tensor:
        soft = self.ctx.run.soft_prompts["prompt_tuned"]
        return self._prefix([soft, question_prompt(self.lm.tokenizer, row["question"])])


class ColdRead(HandoffMethod):
    """The whole context text + the question, zero-shot: the text handoff as used today.

    The sender tokenises the context (the work a text handoff asks of it) and sends its utf-8
    bytes; the receiver decodes them and prefills the cold-read prompt.
    """

    name = "cold_read"
    soft_prompt: str | None = None

    def send(self, row: dict) -> Sent:
        data = row["context"].encode("utf-8")
        self.lm.tokenizer(row["context"], add_special_tokens=False)
        return Sent(message=data, wire_bytes=len(data))

    def receive(self, sent: Sent, row: dict) -> Tensor:
        context = sent.message.decode("utf-8")
        parts = [cold_read_prompt(self.lm.tokenizer, context, row["question"])]
        if self.soft_prompt is not None:
            parts.insert(0, self.ctx.run.soft_prompts[self.soft_prompt])
        return self._prefix(parts)


class ColdReadTuned(ColdRead):
    """K trained constant vectors + the context text + the question: the text handoff at its best."""

    name = "cold_read_tuned"
    requires = ("cold_read_tuned",)
    soft_prompt = "cold_read_tuned"


class ILCP(HandoffMethod):
    """K memory vectors projected from the received latent + the question: the ILCP path.

    Sender: pooling forward + encode + pack + to_bytes. Receiver: from_bytes (verifying the LM
    fingerprint) + unpack + project + the question prompt.
    """

    name = "ilcp"
    requires = ("ilcp",)

    def bind(self, ctx: EvalContext) -> None:
        super().bind(ctx)
        if ctx.handoff is None:
            raise MethodUnavailable("ilcp: no ILCPHandoff was built for this run")

    def send(self, row: dict) -> Sent:
        payload = self.ctx.handoff.send(row["context"])
        data = payload.to_bytes()
        return Sent(message=data, wire_bytes=len(data), tensor_bytes=payload.byte_length())

    def receive(self, sent: Sent, row: dict) -> Tensor:
        return self.ctx.handoff.prefixes(sent.message, [row["question"]])[0]

    def build_prefixes(self, rows: Sequence[dict]) -> Prefixes:
        handoff = self.ctx.handoff
        payload = handoff.send([r["context"] for r in rows], batch_size=self.ctx.pool_batch_size)
        prefixes = handoff.prefixes(payload.to_bytes(), [r["question"] for r in rows])
        # Every row's own payload is a single latent: its size, not the batch's, is what one
        # handoff sends.
        return Prefixes(prefixes=prefixes, wire_bytes=[handoff.wire_bytes] * len(rows),
                        tensor_bytes=[handoff.tensor_bytes] * len(rows))


# --------------------------------------------------------------------------------------------
# registry

_EXACT: dict[str, Callable[[str], HandoffMethod]] = {}
_FAMILIES: dict[str, Callable[[str], HandoffMethod]] = {}


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
    table = _FAMILIES if family else _EXACT
    if name in table and not replace:
        raise ValueError(f"method {name!r} is already registered (pass replace=True to replace it)")
    table[name] = factory


def method_names() -> list[str]:
    """Registered exact names, then families as ``"family:..."``."""
    return sorted(_EXACT) + [f"{f}:..." for f in sorted(_FAMILIES)]


def make_method(name: str) -> HandoffMethod:
    """A new, unbound method for a name. Raises ValueError for an unknown name."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"method name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in _EXACT:
        return _EXACT[name](name)
    family = name.split(":", 1)[0]
    if ":" in name and family in _FAMILIES:
        return _FAMILIES[family](name)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(method_names())}")


_GROUPS: dict[str, tuple[str, ...]] = {}


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
    _GROUPS[name] = tuple(names)


def method_groups() -> dict[str, tuple[str, ...]]:
    """Registered groups and their method names."""
    return dict(_GROUPS)


def expand_method_names(names: Sequence[str]) -> list[str]:
    """Method names with every group replaced by its members, first occurrence kept, in order."""
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"method name must be a non-empty string, got {name!r}")
        out += _GROUPS.get(name.strip(), (name.strip(),))
    return list(dict.fromkeys(out))


for _cls in (NoContext, PromptTuned, ColdRead, ColdReadTuned, ILCP):
    register_method(_cls.name, lambda name, cls=_cls: cls(name))
register_group("default", DEFAULT_METHODS)

from . import rclc_methods  # noqa: E402,F401  (registers the rclc:... family and its groups)

"""Memory slots: learned tokens the sender's frozen LM reads after the context, whose states are
the context's summary, computed without any question.

A context of L tokens gets ``N = clamp(ceil(L / tokens_per_slot), min_slots, max_slots)`` slots:
slot j is a learned input embedding placed at position L + j, after the context. One forward over
[context ; slots] gives each slot's last-layer state (several layers concatenated, by config),
which has read the whole context through the LM's own attention; each slot state goes through the
beta-VAE (one latent per slot, (N, Z) on the wire) and the projector (K vectors per slot), so the
receiver reads N x K vectors and 2k tokens send more latents than 100.

The forward runs in two parts, which causal attention makes equal to one forward over both:
the context alone (`slot_states` runs it, or takes the key/value cache of a forward the sender
already ran), then the N slot tokens reading that cache. A sender that has just read its context
therefore pays only the N slot positions (`ILCPHandoff.send_from_hidden_states` with the forward's
cache); without that cache the cost is its forward over the context plus N positions.

Optional low-rank adapters (``adapter_rank`` > 0, on the LM's linear layers named by config,
`adaptable_modules`) act during the slot part only, as forward hooks added for that forward and
removed after it: the LM object is never changed, so the sender's own generation, the context's
cache and a receiver sharing the same LM in process are what they were. They are exported with
the slots (``pooler.adapters.*``, under the export's digests). Hooks rather than a wrapping
adapter library, because such libraries replace the LM's modules in place, which would change the
model every other user of the loaded LM holds.

    slots = SlotTokens(dim=576, hidden_size=576, tokens_per_slot=16, min_slots=1, max_slots=64)
    states, slot_mask = slot_states(model, slots, attention_mask, layers=(-1,), input_ids=ids)
    encoder = SlotEncoder(BetaVAE(576, 32), projector, slots)   # encoder.latent(states, slot_mask): (B, N, Z)
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compat import cache_kwargs, logits_to_keep_kwargs, output_cache
from .compressor import BetaVAE, kl_divergence
from .model import ILCPEncoder
from .pooling import forward_groups, layer_states, pad_id_of, pad_right, tokenize_contexts
from .projector import GatedLatentToMemoryProjector

__all__ = ["SlotEncoder", "SlotTokens", "slot_counts", "slot_states"]


def slot_counts(lengths: Tensor, tokens_per_slot: int, min_slots: int, max_slots: int) -> Tensor:
    """Slots per context: ceil(length / tokens_per_slot), at least `min_slots`, at most `max_slots`."""
    return (-(-lengths.long() // tokens_per_slot)).clamp(min=min_slots, max=max_slots)


class SlotTokens(nn.Module):
    """The learned slot embeddings (max_slots, H) and the rule for how many a context gets.

    Held where an encoder holds its pooler (exported as ``pooler.embeddings``): the VAE reads each
    slot's state, ``dim`` = H x the number of layers read.
    """

    kind = "slots"

    def __init__(self, dim: int, hidden_size: int, tokens_per_slot: int, min_slots: int, max_slots: int,
                 adapter_rank: int = 0, adapter_modules: Sequence[tuple[str, int, int]] = ()):
        super().__init__()
        for name, value in (("dim", dim), ("hidden_size", hidden_size), ("tokens_per_slot", tokens_per_slot),
                            ("min_slots", min_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < min_slots:
            raise ValueError(f"max_slots must be an int >= min_slots ({min_slots}), got {max_slots!r}")
        self.dim, self.tokens_per_slot, self.min_slots, self.max_slots = dim, tokens_per_slot, min_slots, max_slots
        self.embeddings = nn.Parameter(torch.zeros(max_slots, hidden_size))
        if adapter_rank < 0 or (adapter_rank > 0) != bool(adapter_modules):
            raise ValueError("adapters need a rank >= 1 and the LM modules they adapt (or neither)")
        self.adapter_rank = int(adapter_rank)
        self.adapters = nn.ModuleDict({_key(name): LowRank(n_in, n_out, adapter_rank)
                                       for name, n_in, n_out in adapter_modules})
        self.adapter_modules = tuple((name, n_in, n_out) for name, n_in, n_out in adapter_modules)

    @property
    def output_dim(self) -> int:
        return self.dim

    @property
    def hidden_size(self) -> int:
        return self.embeddings.shape[1]

    def counts(self, lengths: Tensor) -> Tensor:
        """Slots of contexts of these token counts (see `slot_counts`)."""
        return slot_counts(lengths, self.tokens_per_slot, self.min_slots, self.max_slots)

    def adapting(self, model: nn.Module):
        """While inside, the adapted linear layers of `model` add their low-rank updates (forward
        hooks, removed on exit: the LM itself is never changed)."""
        return adapters_acting(model, self.adapter_modules, self.adapters, "slot")

    @torch.no_grad()
    def init_from_embeddings(self, table: Tensor, seed: int = 0) -> None:
        """Start each slot at a random row of the LM's input-embedding table (the scale of real tokens)."""
        if table.dim() != 2 or table.shape[1] != self.hidden_size:
            raise ValueError(f"the embedding table is {tuple(table.shape)}; the slots are {self.hidden_size} wide")
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, table.shape[0], (self.max_slots,), generator=g)
        self.embeddings.copy_(table.detach().float().cpu()[rows].to(self.embeddings.device))


class LowRank(nn.Module):
    """A low-rank update ``B A x`` (rank r; B starts at zero, so an untrained adapter changes nothing)."""

    def __init__(self, n_in: int, n_out: int, rank: int):
        super().__init__()
        self.a = nn.Parameter(torch.randn(rank, n_in) / math.sqrt(n_in))
        self.b = nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(x.to(self.a.dtype), self.a), self.b)


def _key(name: str) -> str:
    return name.replace(".", "__")  # a module name as a ModuleDict key


@contextlib.contextmanager
def adapters_acting(model: nn.Module, modules: Sequence[tuple[str, int, int]], adapters: nn.ModuleDict,
                    owner: str, key=_key):
    """While inside, each linear layer of `model` named in `modules` ((name, in, out)) adds the
    low-rank update ``adapters[key(name)]`` to its output (forward hooks, removed on exit, even on
    an error: the LM itself never changes). ValueError naming `owner` when this LM lacks a module
    or its sizes differ."""
    if not modules:
        yield
        return
    found = dict(model.named_modules())
    missing = [name for name, _, _ in modules if name not in found]
    if missing:
        raise ValueError(f"the {owner} adapters name LM modules this LM lacks: {missing[:3]}")
    hooks = []
    try:
        for name, n_in, n_out in modules:
            module, adapter = found[name], adapters[key(name)]
            if getattr(module, "in_features", n_in) != n_in or getattr(module, "out_features", n_out) != n_out:
                raise ValueError(f"the {owner} adapter of {name} is {n_in} -> {n_out}; this LM's module is not")
            hooks.append(module.register_forward_hook(_adding(adapter)))
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _adding(adapter: LowRank):
    def hook(module, inputs, output):
        return output + adapter(inputs[0]).to(output.dtype)
    return hook


def adaptable_modules(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, int, int]]:
    """(name, in, out) of the LM's linear layers whose names end with one of `targets` ("q_proj")."""
    found = [(name, m.in_features, m.out_features) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    if not found:
        raise ValueError(f"this LM has no linear layer named {list(targets)}")
    return found


def slot_states(model: nn.Module, slots: SlotTokens, attention_mask: Tensor, layers: Sequence[int] = (-1,), *,
                input_ids: Tensor | None = None, cache=None) -> tuple[Tensor, Tensor]:
    """The slot tokens' states after right-padded contexts: ((B, N, D), slot mask (B, N) bool).

    Args:
        model: the sender's LM (frozen; gradients reach the slot embeddings through it).
        attention_mask: (B, S), 1 on the contexts' tokens (right-padded).
        input_ids: (B, S) the contexts' ids; the context forward runs here, without gradients.
        cache: instead of ``input_ids``, the key/value cache of a forward the sender already ran
            over the same right-padded contexts (positions 0..L-1); it is copied, not changed.

    N is the most slots of any row; a row's slots past its own count are masked out.
    """
    if (input_ids is None) == (cache is None):
        raise ValueError("slot_states takes the contexts' input_ids or the cache of their forward, not both")
    mask = attention_mask.long()
    if mask.dim() != 2 or bool((mask.sum(-1) == 0).any()):
        raise ValueError("the attention mask must be (B, S) with at least one real token per row")
    if cache is None:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        use_cache=True, **logits_to_keep_kwargs(model, 1))
        cache = output_cache(out)
    else:
        cache = copy.deepcopy(cache)
    lengths = mask.sum(-1)
    counts = slots.counts(lengths)
    n = int(counts.max())
    positions = torch.arange(n, device=mask.device)
    slot_mask = positions.unsqueeze(0) < counts.unsqueeze(1)
    table = model.get_input_embeddings().weight
    embeds = slots.embeddings[:n].to(device=table.device, dtype=table.dtype).unsqueeze(0).expand(mask.shape[0], -1, -1)
    with slots.adapting(model):  # the adapters act on the slot positions only; the context ran without them
        out = model(inputs_embeds=embeds, attention_mask=torch.cat([mask, slot_mask.long()], dim=-1),
                    position_ids=lengths.unsqueeze(1) + positions.unsqueeze(0), output_hidden_states=True,
                    use_cache=True, **cache_kwargs(model, cache), **logits_to_keep_kwargs(model, 1))
    return layer_states(out, layers), slot_mask


@dataclass(frozen=True)
class BoundSender:
    """The sender LM a training `SlotEncoder` runs its slot forward with (`SlotEncoder.bind_sender`)."""

    model: nn.Module
    tokenizer: object
    max_length: int
    layers: tuple[int, ...]
    grouped: bool


class SlotEncoder(ILCPEncoder):
    """An `ILCPEncoder` whose summary is its slots' states: one latent per slot, (B, N, Z).

    ``latent(states, slot_mask)`` reads the states `slot_states` gives; training binds the sender
    (`bind_sender`) so that `memory_for_batch` runs the slot forward on the batch's contexts with
    gradients reaching the slot embeddings.
    """

    reads_sender_lm = True

    def __init__(self, vae: BetaVAE, projector: GatedLatentToMemoryProjector | None, slots: SlotTokens, **receiver):
        if not isinstance(slots, SlotTokens):
            raise ValueError(f"a slot encoder needs SlotTokens, got {type(slots).__name__}")
        super().__init__(vae, projector, slots, 0, **receiver)
        self._sender: BoundSender | None = None  # outside the state dict

    @property
    def slots(self) -> SlotTokens:
        return self.pooler

    @property
    def chunked(self) -> bool:
        return True  # one latent per slot

    def latent_unit(self) -> str:
        return f"one per memory slot, a slot per {self.slots.tokens_per_slot} tokens"

    def max_latents(self, max_length: int) -> int:
        return int(self.slots.counts(torch.tensor([max_length])))

    def encode(self, states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Slot states (B, N, D) -> (mu, logvar), each (B, N, Z) float32."""
        if states.dim() != 3 or states.shape[-1] != self.slots.dim:
            raise ValueError(f"slot states must be (batch, slots, {self.slots.dim}), got {tuple(states.shape)}")
        b, n, d = states.shape
        mu, logvar = self.vae.encode(states.reshape(b * n, d))
        return mu.view(b, n, -1), logvar.view(b, n, -1)

    def latent_mask(self, attention_mask: Tensor) -> Tensor:
        """The slot mask `slot_states` gave (B, N), as bool."""
        return attention_mask.bool()

    def lm_states(self, model: nn.Module, attention_mask: Tensor, layers: Sequence[int], *,
                  input_ids: Tensor | None = None, cache=None) -> tuple[Tensor, Tensor]:
        """The slot states after right-padded contexts, read by the sender's LM `model` (see
        `slot_states`): what `encode` reads, and their mask."""
        return slot_states(model, self.slots, attention_mask, layers, input_ids=input_ids, cache=cache)

    def bind_sender(self, model: nn.Module, tokenizer, max_length: int, layers: Sequence[int],
                    grouped: bool = True) -> None:
        """The sender LM training runs the slot forward with (held by reference, never exported);
        ``grouped`` (``trainer.length_groups``): a batch's contexts run as one forward per group
        of similar lengths, else as one padded forward."""
        self._sender = BoundSender(model, tokenizer, int(max_length), tuple(layers), bool(grouped))

    def sender_states(self, contexts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """The slot states of context strings through the bound sender, as `ILCPHandoff` sends them
        (no special tokens, the last max_length tokens)."""
        if self._sender is None:
            raise ValueError("this slot encoder has no sender LM: bind_sender(model, tokenizer, max_length, layers)")
        sender = self._sender
        tokens = tokenize_contexts(sender.tokenizer, contexts, sender.max_length)
        device = sender.model.get_input_embeddings().weight.device
        parts, masks, rows = [], [], []
        for group in forward_groups([len(t) for t in tokens], sender.grouped):  # similar lengths share a forward
            ids, mask = pad_right([tokens[i] for i in group], pad_id_of(sender.tokenizer))
            states, slot_mask = slot_states(sender.model, self.slots, mask.to(device), sender.layers,
                                            input_ids=ids.to(device))
            parts.append(states)
            masks.append(slot_mask)
            rows.extend(group)
        n = max(m.shape[1] for m in masks)
        order = torch.tensor(rows, device=device).argsort()  # back in the contexts' order
        states = torch.cat([F.pad(x, (0, 0, 0, n - x.shape[1])) for x in parts])[order]
        slot_mask = torch.cat([F.pad(m, (0, n - m.shape[1])) for m in masks])[order]
        return states, slot_mask

    def memory_for_batch(self, batch: dict, dtype: torch.dtype, sample: bool = False) -> tuple[list[Tensor], Tensor]:
        """(one (N_i * K, H) memory per row in `dtype`, mean KL of the real slots' posteriors); the
        memory of the posterior's mean, or with ``sample`` of a latent drawn from it."""
        states, slot_mask = self.sender_states(batch["context"])
        mu, logvar = self.encode(states, slot_mask)
        memory = self.memory(self.vae.reparameterise(mu, logvar) if sample else mu, dtype)
        k = self.num_memory_tokens
        rows = [memory[i, : int(slot_mask[i].sum()) * k] for i in range(memory.shape[0])]
        return rows, kl_divergence(mu[slot_mask], logvar[slot_mask]).mean()

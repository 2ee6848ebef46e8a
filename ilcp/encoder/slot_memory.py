"""The memory-slot kind's settings (``compressor.memory.kind=slots``, config.json's ``pooling.kind``
"slots"): learned tokens the sender's LM reads after the context (`ilcp.encoder.slots`), one
latent per slot, a slot per ``tokens_per_slot`` context tokens.

Standard library only at import time (a config naming the kind is checked before torch loads);
the modules are built, and the encoder started, inside the methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..settings import setting
from .kinds import MAX_COUNT, MemoryKind

if TYPE_CHECKING:
    from .slots import SlotEncoder

__all__ = ["SlotMemory", "SLOT_STATISTICS_ROWS"]

# the training contexts whose untrained slot states set the VAE's standardisation
SLOT_STATISTICS_ROWS = 256


@dataclass(frozen=True)
class SlotMemory(MemoryKind):
    """Memory slots (`SlotEncoder`): ``tokens_per_slot``, ``min_slots`` and ``max_slots``, and
    optional low-rank adapters on the sender LM's layers (``adapter_rank``; the layers named by
    ``adapter_targets``, resolved against the LM into ``adapters`` when training starts)."""

    kind: ClassVar[str] = "slots"
    reads_sender_lm: ClassVar[bool] = True

    tokens_per_slot: int = setting(16, "one memory slot per this many context tokens", minimum=1, maximum=MAX_COUNT)
    min_slots: int = setting(1, "the fewest slots a context gets", minimum=1, maximum=MAX_COUNT)
    max_slots: int = setting(64, "the most slots a context gets (longer contexts share them)", minimum=1,
                             maximum=MAX_COUNT)
    adapter_rank: int = setting(0, "rank of low-rank adapters on the sender LM's layers, active for the slot "
                                   "positions only (0 = none: the slots alone learn)", minimum=0, maximum=MAX_COUNT,
                                omit_default=True)
    adapter_targets: tuple[str, ...] = setting(("q_proj", "v_proj"), "the LM's linear layers (by name) the slot "
                                               "adapters adapt", exported=False, compare=False)
    # ((LM module name, in, out), ...) the adapters adapt: config.json's ``adapters``, filled in from the LM
    adapters: tuple = setting((), "the adapted LM modules and their sizes", written_with="adapter_rank",
                              configurable=False, compare=False)

    def check(self) -> None:
        if self.max_slots < self.min_slots:
            raise ValueError(f"{self.name_of('max_slots')} ({self.max_slots}) must be >= {self.name_of('min_slots')} "
                             f"({self.min_slots})")
        if not self.adapter_targets or not all(isinstance(t, str) and t for t in self.adapter_targets):
            raise ValueError(f"{self.name_of('adapter_targets')} must be a non-empty list of layer names, "
                             f"got {list(self.adapter_targets)!r}")
        modules = tuple(tuple(m) for m in self.adapters)
        if not all(len(m) == 3 and isinstance(m[0], str) and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 1 for v in m[1:]) for m in modules):
            raise ValueError(f"{self.name_of('adapters')} must map LM module names to [in, out] sizes")
        object.__setattr__(self, "adapters", modules)
        if self.adapters and not self.adapter_rank:
            raise ValueError(f"{self.name_of('adapter_rank')} and {self.name_of('adapters')} come together")

    # ------------------------------------------------------------------ config.json

    def entries(self) -> dict:
        entries = {"kind": "slots", "tokens_per_slot": self.tokens_per_slot, "min_slots": self.min_slots,
                   "max_slots": self.max_slots}
        if self.adapter_rank:
            entries |= {"adapter_rank": self.adapter_rank,
                        "adapters": {name: [n_in, n_out] for name, n_in, n_out in self.adapters}}
        return entries

    @classmethod
    def from_entries(cls, entries: dict) -> SlotMemory:
        adapters = entries.get("adapters", {})
        if not isinstance(adapters, dict) or not all(isinstance(v, list) and len(v) == 2 for v in adapters.values()):
            raise ValueError("'pooling.adapters' must map LM module names to [in, out] sizes")
        kind = super().from_entries({**entries, "adapters": tuple((name, *sizes) for name, sizes in adapters.items())})
        if kind.adapter_rank and not kind.adapters:
            raise ValueError("'pooling.adapter_rank' and 'pooling.adapters' come together")
        return kind

    # ------------------------------------------------------------------ what training asks

    def check_run(self, cfg) -> None:
        if not (cfg.handoff.finetune_encoder or cfg.reconstruct.enabled or cfg.compressor.init_from):
            raise ValueError("compressor.memory.kind=slots trains the slots and the VAE in stage 2 unless a "
                             "pretraining stage (reconstruct.steps > 0) or compressor.init_from trained them: it "
                             "needs handoff.finetune_encoder=true")

    def start(self, cfg, lm, train) -> SlotEncoder:
        """Memory slots start untrained (each at a random row of the LM's embedding table) and learn
        with the VAE and the projector in stage 2, through the LM: stage 1 has no fixed states to
        fit. The VAE's standardisation comes from the untrained slots' states over up to
        `SLOT_STATISTICS_ROWS` training contexts; the encoder is bound to the sender LM."""
        import dataclasses

        import lightning as L
        import torch

        from ..training.data import sender_max_length
        from ..training.log import say
        from .compressor import BetaVAE
        from .slots import adaptable_modules

        c = cfg.compressor
        L.seed_everything(cfg.trainer.seed, verbose=False)
        kind = self
        if self.adapter_rank:
            kind = dataclasses.replace(self, adapters=tuple(adaptable_modules(lm.model, self.adapter_targets)))
        slots = kind.pooler(lm.hidden_size * len(cfg.data.pool_layers), hidden_size=lm.hidden_size)
        slots.init_from_embeddings(lm.model.get_input_embeddings().weight, seed=cfg.trainer.seed)
        encoder = kind.encoder(BetaVAE(slots.output_dim, c.latent_dim, c.hidden_dim, c.beta), None, slots)
        encoder.bind_sender(lm.model, lm.tokenizer, sender_max_length(cfg, lm), cfg.data.pool_layers,
                            grouped=cfg.trainer.length_groups)
        contexts = [r["context"] for r in train.rows[:SLOT_STATISTICS_ROWS]]
        states = []
        with torch.no_grad():
            for start in range(0, len(contexts), cfg.data.pool_batch_size):
                batch, mask = encoder.sender_states(contexts[start:start + cfg.data.pool_batch_size])
                states.append(batch[mask].float().cpu())
        states = torch.cat(states)
        encoder.vae.set_standardisation(states)
        adapters = (f", rank-{self.adapter_rank} adapters on {len(slots.adapter_modules)} LM layers"
                    if self.adapter_rank else "")
        say(f"stage 1 (compressor): memory slots (one per {self.tokens_per_slot} tokens, {self.min_slots} to "
            f"{self.max_slots}{adapters}), trained in stage 2 with the VAE; standardisation from {states.shape[0]} "
            f"slot states of {len(contexts)} training contexts")
        return encoder

    def card_unit(self) -> str:
        return (f"one per slot: a slot per {self.tokens_per_slot} context tokens, {self.min_slots} to {self.max_slots}"
                + (f", rank-{self.adapter_rank} adapters on the sender" if self.adapter_rank else ""))

    # ------------------------------------------------------------------ the modules

    @classmethod
    def from_encoder(cls, encoder) -> SlotMemory | None:
        from .slots import SlotEncoder

        if not isinstance(encoder, SlotEncoder):
            return None
        s = encoder.slots
        return cls(s.tokens_per_slot, s.min_slots, s.max_slots, s.adapter_rank, adapters=s.adapter_modules)

    def pooler(self, state_dim: int, hidden_size: int | None = None):
        from .slots import SlotTokens

        if hidden_size is None:
            raise ValueError("slot tokens need the LM's hidden size")
        return SlotTokens(state_dim, hidden_size, self.tokens_per_slot, self.min_slots, self.max_slots,
                          self.adapter_rank, self.adapters)

    def encoder(self, vae, projector, pooler, **receiver) -> SlotEncoder:
        from .slots import SlotEncoder

        encoder = SlotEncoder(vae, projector, pooler, **receiver)
        encoder.memory_kind = self
        return encoder

"""A new memory kind is one module and one registry entry: a kind registered at run time (defined
in this file alone, touching no other file) is named by the training config, trains, exports,
loads and receives on the tiny LM, and its own trainable module travels as ``pooler.*`` entries
of the export's weights.

The kind here, ``scaled_max``, sends one latent per context: the masked maximum of the token
states, each feature scaled by a learned vector (its own module and state-dict entry)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ilcp.config import load_config
from ilcp.encoder import kinds as memory_kinds
from ilcp.encoder.kinds import MemoryKind, register_memory_kind
from ilcp.export import read_config, read_export
from ilcp.handoff import ILCPHandoff
from ilcp.settings import setting

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


class ScaledMaxPooler(nn.Module):
    """Masked maximum over positions of (B, S, D) token states, times a learned (D,) scale."""

    kind = "scaled_max"

    def __init__(self, dim: int, start: float):
        super().__init__()
        self.dim = dim
        self.scale = nn.Parameter(torch.full((dim,), float(start)))

    @property
    def output_dim(self) -> int:
        return self.dim

    def forward(self, states: Tensor, attention_mask: Tensor) -> Tensor:
        masked = states.float().masked_fill(~attention_mask.bool().unsqueeze(-1), float("-inf"))
        return masked.amax(dim=1).nan_to_num(0.0, neginf=0.0) * self.scale


@dataclass(frozen=True)
class ScaledMaxMemory(MemoryKind):
    """One latent per context: the scaled masked maximum of its token states."""

    kind: ClassVar[str] = "scaled_max"

    start_scale: float = setting(1.0, "the learned scale's starting value", above=0, maximum=100.0)

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> ScaledMaxPooler:
        return ScaledMaxPooler(state_dim, self.start_scale)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(memory_kinds, "_KINDS", dict(memory_kinds._KINDS))  # registered for this test only
    return register_memory_kind(ScaledMaxMemory)


def test_a_kind_registered_at_run_time_trains_exports_loads_and_receives(registered, tmp_path, tiny_lm):
    from ilcp.training import train

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                                    "compressor.memory.kind=scaled_max", "compressor.memory.start_scale=0.5",
                                    "compressor.answer_head_weight=1.0", "handoff.variants=[ilcp]"])
    assert cfg.compressor.memory == ScaledMaxMemory(0.5)
    with pytest.raises(ValueError, match="compressor.memory.start_scale must be > 0"):
        load_config(TINY_CONFIG, ["compressor.memory.kind=scaled_max", "compressor.memory.start_scale=0"])
    result = train(cfg, lm=tiny_lm)

    config = read_config(result.run_dir)
    assert {k: v for k, v in config["pooling"].items() if k not in ("layers", "max_length")} == {
        "kind": "scaled_max", "start_scale": 0.5}
    weights = load_file(str(result.run_dir / "model.safetensors"))
    assert weights["pooler.scale"].shape == (tiny_lm.hidden_size,)
    assert not torch.equal(weights["pooler.scale"], torch.full_like(weights["pooler.scale"], 0.5))  # it trained
    assert "scaled_max pooling" in (result.run_dir / "README.md").read_text()

    run = read_export(result.run_dir)
    assert run.spec.memory == ScaledMaxMemory(0.5) and isinstance(run.encoder.pooler, ScaledMaxPooler)
    torch.testing.assert_close(run.encoder.pooler.scale.detach(), weights["pooler.scale"])

    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    payload = handoff.send("Mary moved to the hallway. John went to the garden.")
    assert payload.latent.shape == (cfg.compressor.latent_dim,)
    answer = handoff.receive(handoff.to_wire(payload), "Where is John?")
    assert isinstance(answer, str)
    assert answer == handoff.receive(payload, "Where is John?")


def test_an_export_of_an_unregistered_kind_is_refused_in_one_line(registered, tmp_path):
    memory_kinds._KINDS.pop("scaled_max")
    with pytest.raises(ValueError, match="compressor.memory.kind must be one of"):
        load_config(TINY_CONFIG, ["compressor.memory.kind=scaled_max"])
    with pytest.raises(ValueError, match="unknown pooling kind 'scaled_max'"):
        memory_kinds.memory_kind_for({"kind": "scaled_max", "start_scale": 1.0})

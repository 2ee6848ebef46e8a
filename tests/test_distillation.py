"""Distillation from the text reader: with handoff.distill_teacher=cold_read_tuned the teacher is
the frozen LM reading the text behind this run's cold_read_tuned vectors, trained first."""

from pathlib import Path

import pytest
import torch

from ilcp.config import load_config
from ilcp.training.handoff_stage import HandoffModule
from ilcp.training.pipeline import training_order

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"

TUNED = ["handoff.variants=[ilcp,cold_read_tuned]", "handoff.distill_weight=1", "handoff.distill_teacher=cold_read_tuned"]


def test_the_tuned_teacher_is_trained_first_and_checked():
    cfg = load_config(TINY_CONFIG, TUNED)
    assert training_order(cfg) == ["cold_read_tuned", "ilcp"]
    with pytest.raises(ValueError, match="add it to handoff.variants"):
        load_config(TINY_CONFIG, ["handoff.variants=[ilcp]", "handoff.distill_teacher=cold_read_tuned"])
    with pytest.raises(ValueError, match="handoff.distill_teacher must be"):
        load_config(TINY_CONFIG, ["handoff.distill_teacher=oracle"])


def test_the_teacher_reads_the_text_behind_the_tuned_vectors(tmp_path, tiny_lm, monkeypatch):
    from ilcp.training import train

    calls = []
    original = HandoffModule._teacher_sequences

    def spy(self, teacher, batch):
        sequences, labels = original(self, teacher, batch)
        calls.append((teacher.soft_prompt.detach().clone(), sequences, labels, batch))
        return sequences, labels

    monkeypatch.setattr(HandoffModule, "_teacher_sequences", spy)
    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *TUNED])
    result = train(cfg, lm=tiny_lm)
    assert calls, "the ilcp stage never asked the tuned teacher"
    vectors, sequences, labels, batch = calls[0]
    k = vectors.shape[0]
    trained = result.sources["cold_read_tuned"].soft_prompt.detach()
    torch.testing.assert_close(vectors, trained)  # the run's own cold_read_tuned vectors, frozen while ilcp trains
    torch.testing.assert_close(sequences[0][:k].float(), trained)  # read first, then the cold-read prompt
    plain = HandoffModule(result.sources["ilcp"], tiny_lm, cfg.handoff)._answer_sequences(None, batch, True)
    assert [len(s) for s in sequences] == [len(s) + k for s in plain[0]]  # the same text prompt behind K vectors

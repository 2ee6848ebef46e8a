"""The answer stage keeps the validation with the most exact answers, a tie going to the lower loss."""
from pathlib import Path

import pytest

from ilcp.config import load_config
from ilcp.training import train
from ilcp.training.handoff_stage import selection_score

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def test_more_exact_answers_outrank_any_loss_and_a_tie_goes_to_the_lower_loss():
    n = 64
    assert selection_score(11 / n, 50.0, n) > selection_score(10 / n, 0.0, n)  # one more answer right wins
    assert selection_score(10 / n, 1.5, n) > selection_score(10 / n, 2.1, n)   # same answers: lower loss wins
    assert selection_score(0.0, 0.0, n) == 0.0
    assert selection_score(10 / n, 1e9, n) > 9 / n                             # stays within one answer's share
    # large validation sets keep the order too
    assert selection_score(1001 / 5000, 30.0, 5000) > selection_score(1000 / 5000, 0.01, 5000)


def test_the_kept_step_is_the_best_exact_match_then_the_lowest_loss(tmp_path, tiny_lm):
    result = train(load_config(TINY_CONFIG, [
        f"out_dir={tmp_path}", "run_name=select", "trainer.progress=false", "handoff.variants=[prompt_tuned]",
        "handoff.max_steps=6", "handoff.val_every_steps=2"]), lm=tiny_lm)
    metrics = result.metrics["variants"]["prompt_tuned"]
    curve = metrics["curve"]
    assert [row["step"] for row in curve] == [2, 4, 6]
    for row in curve:  # configs/tiny.yaml decodes 4 validation questions
        assert row["val/select"] == pytest.approx(selection_score(row["val/exact_match"], row["val/answer_ce"], 4),
                                                  abs=1e-6)
    best_em = max(row["val/exact_match"] for row in curve)
    tied = [row for row in curve if row["val/exact_match"] == best_em]
    expected = min(tied, key=lambda row: row["val/answer_ce"])
    assert metrics["best_step"] == expected["step"]
    assert metrics["best_val_exact_match"] == best_em

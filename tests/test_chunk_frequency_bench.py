"""benchmarks/chunk_readback_by_frequency.py runs on a chunk pretraining and accounts for every
held-out token once, in one frequency bucket and one place."""

import json
import sys
from pathlib import Path

from ilcp.training.chunk_pretrain import ChunkPretrainConfig, pretrain

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import chunk_readback_by_frequency as bench  # noqa: E402


def test_the_frequency_benchmark_splits_every_held_out_token(tiny_lm, tmp_path):
    pretrain(tmp_path / "run", tiny_lm, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=2, eval_every=2,
                                                            heldout_chunks=6, width=8, inner=16, babi_stories=10),
             log=lambda _m: None)
    assert bench.main(["--run", str(tmp_path / "run"), "--lm", "tiny-qwen3", "--dtype", "float32",
                       "--json", str(tmp_path / "out.json")]) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert sum(b["held-out tokens"] for b in report["by_training_frequency"]) == 6 * 4
    assert len(report["by_place_in_chunk"]) == 4 and report["step"] == 2
    assert [bench.bucket(n) for n in (0, 5, 50, 500, 5000)] == ["0", "1-9", "10-99", "100-999", "1000+"]

"""A run and its resume show the user no warning from this package or from how it drives Lightning."""

import warnings
from pathlib import Path

from ilcp.config import load_config
from ilcp.training import train

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")  # Lightning's own
        call()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_a_tiny_run_and_its_resume_warn_of_nothing(tmp_path, tiny_lm):
    base = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}"]
    first = []
    assert _warnings_of(lambda: first.append(train(load_config(TINY_CONFIG, base), lm=tiny_lm))) == []
    stage = first[0].run_dir / "stages" / "prompt_tuned"
    for name in ("prompt_tuned.safetensors", "metrics.json"):  # interrupted after its last checkpoint
        (stage / name).unlink()
    resumed = load_config(TINY_CONFIG, base + ["handoff.max_steps=6"])
    assert _warnings_of(lambda: train(resumed, lm=tiny_lm, resume=True)) == []

"""benchmarks/route_agreement.py on the tiny LM: a pretrained encoder's reconstruction validation
loss through one padded forward and through length groups, at both precisions; in float32 the two
routes agree."""

import json
import re

import pytest

from _benchmarks import REPO, load_benchmark
from ilcp.config import load_config
from ilcp.training import train
from test_pretraining import TINY  # the pretraining recipe at the tiny LM's size

bench = load_benchmark("route_agreement")


def test_both_routes_score_the_same_encoder_alike(tmp_path, tiny_lm, capsys):
    settings = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *TINY]
    run = train(load_config(REPO / "configs" / "pretrain.yaml", settings), lm=tiny_lm)
    assert bench.main(["--export", str(run.run_dir), "--set", *settings, "--json", str(tmp_path / "routes.json")]) == 0
    figures = json.loads((tmp_path / "routes.json").read_text())
    assert [(r["route"], r["precision"]) for r in figures["rows"]] == [
        ("one padded forward", "32-true"), ("length groups", "32-true"),
        ("one padded forward", "bf16-mixed"), ("length groups", "bf16-mixed")]
    assert figures["texts"] > 0 and all(r["val_loss"] > 0 for r in figures["rows"])
    assert figures["largest_batch_difference"]["32-true"] < 1e-4
    out = capsys.readouterr().out
    assert "| length groups | 32-true |" in out
    assert float(re.search(r"difference between the routes: (\S+) in 32-true", out).group(1)) < 1e-4


def test_an_export_that_is_not_one_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--export", str(tmp_path / "nowhere"), "--set", "lm.spec=tiny-qwen3"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "compressor.init_from=" in err.strip().splitlines()[-1]
    assert "is not a directory" in err

"""benchmarks/length_groups.py on the tiny LM: both routes run the answer stage's own loss on the
same batches, print their timings, and agree on the loss."""

import json
import re

import pytest

from _benchmarks import REPO, load_benchmark

bench = load_benchmark("length_groups")


def test_the_benchmark_times_both_routes_and_their_losses_agree(capsys, tmp_path):
    assert bench.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--lm", "tiny-qwen3", "--batches", "2",
                       "--batch-size", "4", "--json", str(tmp_path / "groups.json")]) == 0
    figures = json.loads((tmp_path / "groups.json").read_text())
    assert [r["route"] for r in figures["rows"]] == ["one padded forward", "length groups"]
    assert figures["provenance"]["commit"] and figures["largest_loss_difference"] < 1e-3
    out = capsys.readouterr().out
    assert "| one padded forward |" in out and "| length groups |" in out
    assert float(re.search(r"largest loss difference (\S+)", out).group(1)) < 1e-3
    assert re.search(r"computes (\S+) context positions per real one", out)


def test_bad_arguments_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--batches", "0"])
    assert "--batches and --batch-size must be at least 1" in capsys.readouterr().err

"""benchmarks/precision_speed.py: every row is timed in float32 and in bf16 autocast, and the
printed table and the JSON agree (behaviour only: no speed is asserted)."""

import json

import pytest
from _benchmarks import load_benchmark

ROWS = ["train_step", "prefill_512", "prefill_2048", "decode"]


speed = load_benchmark("precision_speed")


def _table_rows(printed: str) -> dict[str, list[str]]:
    """The Markdown table's body: row name -> its cells."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in printed.splitlines() if line.startswith("| ")]
    header, body = cells[0], cells[1:]
    assert header[:5] == ["row", "what runs", "float32 s", "bf16 s", "ratio"]
    return {row[0]: row for row in body}


def test_every_row_has_both_precisions_and_a_ratio(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert speed.main(["--lm", "tiny-qwen3", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out

    table = _table_rows(printed)
    assert list(table) == ROWS
    for cells in table.values():
        float32_s, bf16_s = float(cells[2]), float(cells[3])
        assert float32_s > 0 and bf16_s > 0, cells
        assert cells[4].endswith("x") and float(cells[4][:-1]) > 0, cells

    report = json.loads(out.read_text())
    assert report["lm"] == "tiny-qwen3" and report["repeats"] == 1
    assert report["auto_precision"] in ("bf16-mixed", "32-true") and report["torch_threads"] >= 1
    assert isinstance(report["avx512_bf16"], bool) and isinstance(report["amx_bf16"], bool) and report["cpu"]
    assert [r["name"] for r in report["rows"]] == ROWS
    for r in report["rows"]:
        assert r["float32_s"] > 0 and r["bf16_s"] > 0
        assert r["ratio"] == pytest.approx(r["float32_s"] / r["bf16_s"])
        assert f"{r['ratio']:.2f}x" == table[r["name"]][4]
    # the soft prompt's loss is the same loss in both precisions, to bf16's accuracy
    train = report["rows"][0]
    assert train["loss_float32"] == pytest.approx(train["loss_bf16"], rel=0.05)
    decode = report["rows"][-1]
    assert 1 <= decode["steps_float32"] <= 8 and 1 <= decode["steps_bf16"] <= 8
    # the machine line names what auto resolves to
    assert f"precision auto on cpu -> {report['auto_precision']}" in printed


def test_the_cpu_model_and_the_decode_steps():
    assert speed.cpu_model("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: fpu\n") \
        == "Intel(R) Xeon(R) Platinum 8480+"
    assert speed.cpu_model("processor\t: 0\n")  # something, never empty
    assert speed.decode_steps([[5, 6], [7]]) == 3  # the longer row and its end token
    assert speed.decode_steps([list(range(8)), [1]]) == 8  # a row that ran out of budget


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats"),
    (["--threads", "0"], "--threads"),
    (["--lm", "no-such-lm"], "unknown LM spec"),
])
def test_the_command_line_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        speed.main(argv)
    assert message in capsys.readouterr().err

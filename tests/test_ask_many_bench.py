"""benchmarks/ask_many.py: every question is timed both ways and the table and the JSON agree
(behaviour only: no speed is asserted)."""

import json

from _benchmarks import load_benchmark

bench = load_benchmark("ask_many")


def test_each_question_is_timed_by_receive_and_by_ask(tiny_run, tmp_path, capsys):
    out = tmp_path / "ask_many.json"
    assert bench.main(["--ckpt", str(tiny_run.run_dir), "--questions", "3", "--rounds", "2",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["question"] for r in rows] == bench.QUESTIONS[:3]
    assert report["shared_positions"] > 0 and report["open_s"] > 0
    for i, r in enumerate(rows):
        assert r["receive_s"] > 0 and r["ask_s"] > 0
        own = r["receive_positions"] - report["shared_positions"]
        assert r["ask_positions"] == (r["receive_positions"] if i == 0 else own) and own > 0
    assert report["later_ask_s"] == sum(r["ask_s"] for r in rows[1:]) / 2
    table = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + 3
    assert "questions 2..3: receive" in printed and "on one opened memory, receive / ask" in printed


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert bench.main(["--ckpt", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "ask_many.py: error:" in err

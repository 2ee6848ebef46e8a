"""benchmarks/receiver_speed.py: every row is timed in each column, beside a bare forward of the
same positions, and the table and the JSON agree (behaviour only: no speed is asserted)."""

import json

from _benchmarks import load_benchmark

speed = load_benchmark("receiver_speed")


def test_each_method_is_timed_in_every_column_beside_one_forward(tiny_run, tmp_path, capsys):
    out = tmp_path / "receiver.json"
    assert speed.main(["--ckpt", str(tiny_run.run_dir), "--requests", "2", "--long-requests", "1",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["no_context", "ilcp", "cold_read"]
    assert rows["cold_read"]["positions"] > 10 * rows["no_context"]["positions"]  # the 2k-token context
    assert rows["ilcp"]["positions"] > rows["no_context"]["positions"]  # the K memory vectors
    for r in rows.values():
        for column in speed.COLUMNS:
            assert r[f"{column} ttft_s"] > 0 and r[f"{column} forward_s"] > 0
        assert r["float32 / bf16 held"] == r["float32 ttft_s"] / r["bf16 held ttft_s"]
    table = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + 3 * len(speed.COLUMNS)
    assert "short requests, float32 TTFT / bf16-held TTFT: no_context" in printed


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    try:
        speed.main(["--ckpt", str(tmp_path)])
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "holds no config.json" in err

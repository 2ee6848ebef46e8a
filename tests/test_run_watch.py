"""benchmarks/run_watch.py: the command's lines are logged with their times, its exit status is
passed on, and the longest silence and the process tree's peak anonymous memory are found (a
child that allocates 200 MB and is silent for 1.5 s)."""

import json
import sys

from _benchmarks import load_benchmark

watch = load_benchmark("run_watch")

CHILD = """
import subprocess, sys, time
print("first", flush=True)
time.sleep(1.5)
sys.stderr.write("bar 1/2\\rbar 2/2\\n")
sys.stderr.flush()
# a grandchild holds the memory: the tree is measured, not only the command's own process
subprocess.run([sys.executable, "-c", "import time; x = bytearray(200 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(1)"])
sys.exit(3)
"""


def test_lines_silence_memory_and_exit_status(tmp_path, capsys):
    log, out = tmp_path / "run.log", tmp_path / "run.json"
    code = watch.main(["--log", str(log), "--json", str(out), "--interval", "0.05", "--", sys.executable, "-c", CHILD])
    assert code == 3
    lines = log.read_text().splitlines()
    assert [line.split(None, 1)[1] for line in lines] == ["first", "bar 1/2", "bar 2/2"]  # stderr joined, \r split
    assert float(lines[1].split()[0]) - float(lines[0].split()[0]) >= 1.4
    report = json.loads(out.read_text())
    assert report["exit_status"] == 3 and report["lines"] == 3
    assert report["longest_silence_s"] >= 1.4
    assert report["peak_anonymous_bytes"] >= 200 << 20
    printed = capsys.readouterr().out
    assert "exit status 3" in printed and "longest silence" in printed


def test_no_command_is_a_usage_error(tmp_path, capsys):
    try:
        watch.main(["--log", str(tmp_path / "x.log")])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("expected a usage error")
    assert "give the command to run after --" in capsys.readouterr().err

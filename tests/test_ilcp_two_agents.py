"""examples/ilcp_two_agents.py: two processes, the sealed wire passed between them over a pipe,
several questions on the memory opened once, the same bytes refused again (on the tiny run)."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ilcp_two_agents.py"


def run_example(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_two_agents_hand_a_sealed_wire_over_and_ask_it_four_questions(tiny_run):
    done = run_example(str(tiny_run.run_dir), "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    sent = next(line for line in lines if line.startswith("A: sent"))
    size = int(re.search(r"(\d+) sealed bytes", sent).group(1))
    assert any(line.startswith(f"B: opened {size} bytes once into ") for line in lines), lines
    asked = [line for line in lines if line.startswith("B: ") and " -> " in line]
    assert [line.split(" -> ")[0] for line in asked] == ["B: Where is Mary?", "B: Where is John?",
                                                          "B: Who has the milk?", "B: Where is Daniel?"]
    assert any(line.startswith("B: the memory says the notes were: ") for line in lines)
    assert any(line.startswith("B: the same bytes again: refused (replayed payload") for line in lines), lines
    assert lines[-1].startswith("done in ") and lines[-1].endswith(f"4 questions after one open of {size} bytes")
    # A prints before B opens: the wire crossed from one process to the other.
    assert lines.index(sent) < next(i for i, line in enumerate(lines) if line.startswith("B: opened"))


def test_a_folder_that_is_not_an_export_is_one_line(tmp_path):
    done = run_example(str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "holds no config.json: pass an ILCP export" in done.stderr.splitlines()[-1]

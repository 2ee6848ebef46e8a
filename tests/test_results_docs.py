"""docs/results and the generated blocks of README.md and docs/*.md are what the JSON files give: nothing drifts."""

import json
import shutil
from pathlib import Path

import pytest

from ilcp_experiments import results_docs
from ilcp_experiments.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def test_every_generated_file_is_what_the_report_command_writes():
    stale = [p.relative_to(ROOT).as_posix() for p in results_docs.stale(ROOT)]
    assert stale == [], f"out of date (run `python -m ilcp_experiments report`): {stale}"


def test_every_figure_of_the_results_at_a_glance_is_read_from_a_results_json():
    rows = results_docs.glance_rows(ROOT / results_docs.RESULTS_DIR)
    assert len(rows) == len(results_docs.GLANCE)  # no row quietly left out
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- results:begin -->")[1].split("<!-- results:end -->")[0]
    assert block.strip() == results_docs.glance_table(ROOT / results_docs.RESULTS_DIR, "docs/results/").strip()
    # the trained task, a held-out task, real text and a long context, each with the text, ILCP and RCLC
    tasks = {task: {r["method"].split(":")[0] for r in rows if r["task"] == task} for task in {r["task"] for r in rows}}
    assert set(tasks) == {"babi:1", "babi:11", "squad", "babilong:1:2k"}
    for task, methods in tasks.items():
        assert {"ilcp", "rclc"} <= methods and methods & {"cold_read", "cold_read_tuned"}, task
    squad = [line for line in block.splitlines() if line.startswith("| SQuAD |")]
    assert squad and all("| F1 " in line for line in squad)  # SQuAD is scored by F1, the others by exact match
    assert all("| EM " in line for line in block.splitlines() if line.startswith("| bAbI"))


def test_the_docs_pages_hold_the_blocks_moved_out_of_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page, name in (("long-contexts.md", "babilong"), ("serving.md", "served")):
        text = (ROOT / "docs" / page).read_text()
        assert f"<!-- {name}:begin -->" in text and f"<!-- {name}:begin -->" not in readme, page
        assert f"(docs/{page})" in readme, f"the README does not link docs/{page}"
    assert "](results/" in (ROOT / "docs" / "long-contexts.md").read_text()  # links relative to docs/


def test_every_results_folder_says_how_it_was_made():
    for folder in results_docs.experiment_folders(ROOT / results_docs.RESULTS_DIR):
        text = (folder / "README.md").read_text()
        assert "## How it was made" in text, folder.name
        assert "```bash" in text, f"{folder.name}: no command recorded"


def _eval_result(tasks: dict) -> dict:
    methods = {name: {"n": 10, "exact_match": em, "exact_match_ci": [max(0.0, em - 0.1), min(1.0, em + 0.1)],
                      "contains": em, "contains_ci": None, "f1": em, "wire_bytes": b, "tensor_bytes": 0,
                      "prefill_positions": 40.0, "latency": {"n": 0}}
               for name, (em, b) in tasks.items()}
    return {"run": {"path": "checkpoints/x", "lm_spec": "tiny-qwen3", "fingerprint": "f", "train_task": "babi:1"},
            "settings": {"limit": 10, "latency_n": 0, "batch_size": 8, "max_new_tokens": 8},
            "tasks": {"babilong:1:0": {"seen_in_training": False, "source": "s", "n": 10, "available": 10,
                                       "limit": 10, "methods": methods},
                      "babilong:1:1k": {"seen_in_training": False, "source": "s", "n": 10, "available": 10,
                                        "limit": 10, "methods": methods}},
            "seconds": 1.0, "provenance": {"command": ["python eval.py --ckpt checkpoints/x"], "date": "2027-01-01"}}


def test_a_folder_the_generator_has_not_seen_is_rendered_and_its_notes_kept(tmp_path):
    shutil.copytree(ROOT / "docs" / "results" / "main-float32", tmp_path / "docs" / "results" / "main-float32")
    shutil.copytree(ROOT / "docs" / "results" / "default-rclc", tmp_path / "docs" / "results" / "default-rclc")
    (tmp_path / "README.md").write_text("intro\n<!-- results:begin -->\nold\n<!-- results:end -->\n")
    (tmp_path / "docs" / "long-contexts.md").write_text("# Long\n\n<!-- babilong:begin -->\n<!-- babilong:end -->\n")
    (tmp_path / "docs" / "plain.md").write_text("# A page without blocks\n")
    new = tmp_path / "docs" / "results" / "babilong-story-4k"
    new.mkdir()
    (new / "results.json").write_text(json.dumps(_eval_result({"ilcp": (0.3, 163), "prompt_tuned": (0.2, 0)})))
    (new / "notes.md").write_text("# The default run at 4k\n\nWhat this shows: a hand-written line.\n")
    other = tmp_path / "docs" / "results" / "new-benchmark"
    other.mkdir()
    (other / "report.json").write_text(json.dumps({"threads": 2, "rows": [{"batch": 1, "tok_s": 313.5}],
                                                   "machine": {"cpu": "x"}}))

    assert main(["report", "--root", str(tmp_path)]) == 0
    readme = (new / "README.md").read_text()
    assert readme.startswith("# The default run at 4k\n")
    assert "What this shows: a hand-written line." in readme
    assert "python eval.py --ckpt checkpoints/x" in readme and "2027-01-01" in readme
    assert "not recorded" in readme  # commit, versions and machine were not in its results.json
    generic = (other / "README.md").read_text()
    assert "| batch | tok_s |" in generic and "| 1 | 313.5 |" in generic and "Command: not recorded." in generic
    top = (tmp_path / "README.md").read_text()
    assert "`rclc:chunkkv:b16`" in top.split("<!-- results:begin -->")[1] and "\nold\n" not in top
    assert "[default-rclc]: docs/results/default-rclc/README.md" in top  # the README's links start at the root
    page = (tmp_path / "docs" / "long-contexts.md").read_text()  # a page of docs/ links from docs/
    assert page.startswith("# Long\n") and "[babilong-story-4k](results/babilong-story-4k/README.md)" in page
    assert "| method | babilong:1:0 (n=10) | babilong:1:1k (n=10) | wire bytes |" in page
    # exact match with its interval on each task, then the receiver's cost at the longest context
    assert "at babilong:1:1k" in page and "| `ilcp` | 30.0 [20.0, 40.0] | 30.0 [20.0, 40.0] | 163 | 40 | - / - | - | - |" in page
    assert "babilong" not in top.split("<!-- results:end -->")[1]
    assert (tmp_path / "docs" / "plain.md").read_text() == "# A page without blocks\n"
    assert (tmp_path / "docs" / "results" / "at_a_glance.png").is_file()
    assert main(["report", "--root", str(tmp_path), "--check"]) == 0

    (new / "notes.md").write_text("# The default run at 4k\n\nWhat this shows: changed.\n")
    assert main(["report", "--root", str(tmp_path), "--check"]) == 1  # a changed source makes the docs stale


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="results:begin"):
        results_docs.replace_block("no markers here", "results", "x")


def test_the_babilong_block_keeps_methods_over_lengths_and_grids_rclc_rows(tmp_path):
    results = tmp_path / "results"
    story = results / "babilong-story"
    story.mkdir(parents=True)
    (story / "results.json").write_text(json.dumps(_eval_result({"ilcp": (0.3, 163), "cold_read": (0.0, 900)})))
    grid = {f"rclc:{sel}:{b}{tuned}": (em, 1000) for sel, em in (("qsnap", 0.1), ("overlap", 0.2))
            for b in ("r1", "r4", "r8") for tuned in ("", ":tuned")}
    grid["kv_relay:cacheback:r8"] = (0.05, 500)
    rclc = _eval_result(grid)
    rclc["tasks"] = {"babilong:1:2k": rclc["tasks"]["babilong:1:1k"]}
    (results / "babilong-rclc-2k").mkdir()
    (results / "babilong-rclc-2k" / "results.json").write_text(json.dumps(rclc))
    reread = _eval_result({"rclc:reread:r4": (0.3, 1000), "rclc:reread:r8": (0.4, 1000), "rclc:overlap:r4": (0.9, 1000)})
    reread["tasks"] = {"babilong:1:2k": reread["tasks"]["babilong:1:1k"]}
    for metrics in reread["tasks"]["babilong:1:2k"]["methods"].values():
        metrics["n"] = 4
    (results / "babilong-rclc-2k-reread").mkdir()  # a second 2k folder: its rows join the same grid
    (results / "babilong-rclc-2k-reread" / "results.json").write_text(json.dumps(reread))
    (results / "babilong-1k").mkdir()
    (results / "babilong-1k" / "results.json").write_text(json.dumps(_eval_result({"ilcp": (0.1, 163)})))
    block = results_docs.babilong_block(results)
    length_table = block.split("\n\n")[1]
    assert "`ilcp`" in length_table and "`cold_read`" in length_table and "rclc:" not in length_table
    assert "RCLC rows at babilong:1:2k (n=4/10, [babilong-rclc-2k](babilong-rclc-2k/README.md), " \
           "[babilong-rclc-2k-reread](babilong-rclc-2k-reread/README.md))" in block
    assert block.count("RCLC rows at") == 1
    assert "| selector | r1 | r4 | r8 | r1 :tuned | r4 :tuned | r8 :tuned |" in block
    assert "| `overlap` | " + " | ".join(["20.0 [10.0, 30.0]"] * 6) + " |" in block  # the first folder's row wins
    assert "| `reread` | - | 30.0 [20.0, 40.0] | 40.0 [30.0, 50.0] | - | - | - |" in block
    assert "`rclc:reread:r8` 40.0% exact" in block  # the r8 target reads both 2k folders
    assert "| `kv_relay:cacheback` (cache entries) | - | - | 5.0 [0.0, 15.0] | - | - | - |" in block
    assert "Other recipes: [babilong-1k]" in block
    # docs/long-contexts.md's block: a link, not the grid
    short = results_docs.babilong_block(results, "docs/results/", full=False)
    assert "RCLC rows at" not in short and "[babilong.md](docs/results/babilong.md)" in short
    assert "The targets" not in short and "Other recipes" not in short
    assert short.split("\n\n")[:2] == block.replace("](", "](docs/results/").split("\n\n")[:2]
    assert "![babilong_lengths](babilong_lengths.png)" in block and "babilong_ttft_2k" not in block  # none timed
    assert [p.name for p in results_docs.draw_babilong(results)] == ["babilong_lengths.png"]
    assert (results / "babilong_lengths.png").stat().st_size > 0


def test_the_held_out_target_reads_each_recipes_folder(tmp_path):
    for folder, (ilcp, tuned) in (("babilong-story-heldout", (0.3, 0.3)), ("babilong-mix", (0.45, 0.2))):
        result = _eval_result({"ilcp": (ilcp, 163), "prompt_tuned": (tuned, 0)})
        methods = result["tasks"]["babilong:1:1k"]
        result["tasks"] = {"babilong:2:2k": methods, "babilong:3:2k": methods}
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps(result))
    assert results_docs.babilong_targets(tmp_path) == [
        "- held-out tasks, ilcp at least 10 points above prompt_tuned: trained on task 1 (`babilong-story-heldout`): "
        "babilong:2:2k +0 points, babilong:3:2k +0 points; trained on tasks 1, 7 and 8 (`babilong-mix`): "
        "babilong:2:2k +25 points, babilong:3:2k +25 points."]


def test_a_relabeled_method_is_its_own_row_and_both_text_references_reach_the_target(tmp_path):
    story = _eval_result({"ilcp": (0.3, 163), "cold_read": (0.0, 9000)})
    story["tasks"] = {"babilong:1:2k": story["tasks"]["babilong:1:1k"], "babilong:1:1k": story["tasks"]["babilong:1:1k"]}
    story["tasks"]["babilong:1:2k"]["methods"]["cold_read"]["prefill_positions"] = 2000.0
    for folder, tuned in (("babilong-story", None), ("babilong-cold-read-tuned", 0.01), ("babilong-text-tuned", 0.4)):
        result = story if tuned is None else _eval_result({"cold_read_tuned": (tuned, 9000)})
        if tuned is not None:
            result["tasks"] = {"babilong:1:2k": result["tasks"]["babilong:1:1k"],
                               "babilong:1:1k": result["tasks"]["babilong:1:1k"]}
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps(result))
    block = results_docs.babilong_block(tmp_path)
    assert "| `cold_read_tuned@0.5k` | 40.0 [30.0, 50.0] | 40.0 [30.0, 50.0] |" in block
    assert "| `cold_read_tuned` | 1.0 [0.0, 11.0] | 1.0 [0.0, 11.0] |" in block
    assert "`cold_read_tuned@0.5k` is cold_read_tuned with vectors trained at 0.5k" in block
    assert results_docs.babilong_targets(tmp_path)[0].startswith(
        "- 2k, ilcp at or above cold_read_tuned with at most 1/16 of the text's positions and 1/10 of its time to "
        "first token: ilcp 30.0% against cold_read_tuned 1.0% (its vectors trained on the plain stories, "
        "`babilong-cold-read-tuned`) and 40.0% (its vectors trained at 0.5k, `babilong-text-tuned`) on 10 questions, "
        "prefix 1/50 of the text's positions")


def test_the_served_block_renders_the_load_benchmark(tmp_path):
    folder = tmp_path / "served-load"
    folder.mkdir()
    data = {"provenance": {"command": "python benchmarks/served_load.py --start", "date": "2027-01-01"},
            "ilcp serial": {"requests": 8, "answers/s": 2.0},
            "ilcp agents=32": {"answers/s": 9.5, "p50 s": 1.25, "p99 s": 2.0, "equal to serial": "8/8", "failed": []},
            "fault": {"requests": 40, "answered": 10, "answered equal to serial": 10, "ServerError": 30,
                      "other exceptions": [], "agents still waiting at the end": 0, "slowest request s": 2.5,
                      "timeout s": 30.0, "killed at s": 5.0, "restart s": 20.0},
            "refusals": {"corrupt": "refused: CRC", "foreign model": "ANSWERED (not refused)",
                         "requests that reached the server": 0}}
    (folder / "served_load.json").write_text(json.dumps(data))
    block = results_docs.served_block(tmp_path)
    assert "`python benchmarks/served_load.py --start`" in block and "2027-01-01" in block
    assert "| ilcp | 8 | 2.0 | 9.5, 1.2 / 2.0, 8/8 |" in block
    assert "of 40 requests 10 answered (10 equal to serial) and 30 raised `ServerError`" in block
    assert "refused before any request: corrupt (0 requests" in block  # the answered one is not listed
    assert results_docs.served_block(tmp_path / "none") == "No served-receiver measurements yet."


def test_the_general_block_splits_trained_and_held_out_tasks_and_draws_both_figures(tmp_path):
    assert results_docs.general_block(tmp_path).startswith("No measurements of the general handoff yet")
    assert results_docs.draw_general(tmp_path) == []
    folder = tmp_path / results_docs.GENERAL_FOLDER
    folder.mkdir()

    def method(em, f1=None, positions=48):
        return {"exact_match": em, "exact_match_ci": [em / 2, min(1.0, em * 1.5)], "n": 200, "f1": f1,
                "f1_ci": None if f1 is None else [f1 - 0.05, f1 + 0.05], "prefill_positions": positions}

    tasks = {"squad": {"seen_in_training": True, "n": 200,
                       "methods": {"ilcp": method(0.1, 0.3, 60), "cold_read_tuned": method(0.2, 0.4, 220)}},
             "babi:1": {"seen_in_training": True, "n": 200,
                        "methods": {"ilcp": method(0.5), "cold_read_tuned": method(0.6)}},
             "babi:2": {"seen_in_training": False, "n": 200,
                        "methods": {"ilcp": method(0.2), "cold_read_tuned": method(0.4)}}}
    (folder / "results.json").write_text(json.dumps({"tasks": tasks, "settings": {}, "run": {}}))
    drawn = results_docs.draw_general(tmp_path)
    assert [p.name for p in drawn] == ["general_squad_f1.png", "general_tasks.png"]
    assert all(p.stat().st_size > 0 for p in drawn)
    block = results_docs.general_block(tmp_path, "docs/results/")
    lines = block.splitlines()
    assert lines[0] == "| task | `ilcp` | `cold_read_tuned` |"
    assert "| babi:2 (held out) | 20.0 | 40.0 |" in lines
    assert "| **mean, trained (2)** | 30.0 | 40.0 |" in lines  # (10 + 50) / 2 and (20 + 60) / 2
    assert "| **mean, held out (1)** | 20.0 | 40.0 |" in lines
    assert lines.index("| babi:2 (held out) | 20.0 | 40.0 |") > lines.index("| babi:1 | 50.0 | 60.0 |")
    assert "`ilcp` F1 30.0 [25.0, 35.0] with 60 prefix positions" in block
    assert f"![general_tasks](docs/results/{folder.name}/general_tasks.png)" in block
    # another handoff on the same questions joins as a column where it has the task with as many questions
    side = {"squad": {"n": 200, "methods": {"ilcp": method(0.05, 0.25, 90)}},
            "babi:1": {"n": 200, "methods": {"ilcp": method(0.3)}},
            "babi:2": {"n": 100, "methods": {"ilcp": method(0.9)}}}
    (tmp_path / "general-codec").mkdir()
    (tmp_path / "general-codec" / "results.json").write_text(json.dumps({"tasks": side, "settings": {}, "run": {}}))
    block = results_docs.general_block(tmp_path, "docs/results/")
    lines = block.splitlines()
    assert lines[0] == "| task | `ilcp` | `cold_read_tuned` | `codec` |"
    assert "| babi:1 | 50.0 | 60.0 | 30.0 |" in lines
    assert "| babi:2 (held out) | 20.0 | 40.0 | - |" in lines  # 100 questions, not the run's 200
    assert "| **mean, trained (2)** | 30.0 | 40.0 | 17.5 |" in lines
    assert "| **mean, held out (1)** | 20.0 | 40.0 | - |" in lines
    assert "`codec` F1 25.0 [20.0, 30.0] with 90 prefix positions" in block
    assert (f"Data: [{folder.name}](docs/results/{folder.name}/README.md), "
            "[general-codec](docs/results/general-codec/README.md).") in block
    assert len(results_docs.draw_general(tmp_path)) == 2
    # one folder can give two columns (general-long: its tuned text and its slots), linked once
    (tmp_path / "general-long").mkdir()
    longer = {"babi:1": {"n": 200, "methods": {"ilcp": method(0.55), "cold_read_tuned": method(0.65)}}}
    (tmp_path / "general-long" / "results.json").write_text(json.dumps({"tasks": longer, "settings": {}, "run": {}}))
    lines = results_docs.general_block(tmp_path, "docs/results/").splitlines()
    assert lines[0] == "| task | `ilcp` | `cold_read_tuned` | `codec` | `cold_read_tuned (long)` | `ilcp (long)` |"
    assert "| babi:1 | 50.0 | 60.0 | 30.0 | 65.0 | 55.0 |" in lines
    data_line = next(line for line in lines if line.startswith("Data: "))
    assert data_line.count("general-long/README.md") == 1

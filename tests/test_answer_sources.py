"""benchmarks/answer_sources.py: what each answer is against its bAbI story, read back from the
row ids eval writes (plain bAbI and BABILong rows)."""

import json

import pytest
from _benchmarks import load_benchmark

from ilcp.tasks import load_babi

sources = load_benchmark("answer_sources")


def test_an_answer_is_classed_against_its_story():
    story = ["Mary moved to the bathroom.", "John went to the hallway.", "Mary travelled back to the office.",
             "Daniel is in the garden."]
    assert sources.sources(story, "Office.\nmore", "office") == {
        "gold": True, "story location": True, "some person's last location": True, "one word": True}
    assert sources.sources(story, "the bathroom", "office") == {  # named, but no one is there now
        "gold": False, "story location": True, "some person's last location": False, "one word": True}
    assert sources.sources(story, "kitchen", "office")["story location"] is False
    assert sources.sources(story, "Mary is in the office", "office")["one word"] is False


def test_rows_of_babi_and_babilong_ids_are_counted_per_task_and_method(tmp_path, capsys):
    row = load_babi(2, "test", limit=1).to_list()[0]
    tail = row["id"][len("babi-qa2"):]
    rows = [{"task": "babilong:2:2k", "id": "babilong-qa2-2k" + tail, "method": m, "question": row["question"],
             "answer": row["answer"], "prediction": p} for m, p in (("ilcp", row["answer"]), ("prompt_tuned", "nowhere"))]
    rows.append({"task": "babi:2", "id": row["id"], "method": "ilcp", "question": row["question"],
                 "answer": row["answer"], "prediction": "nowhere"})
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sources.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    table = json.loads((tmp_path / "s.json").read_text())["tasks"]
    assert table["babilong:2:2k"]["ilcp"]["gold"] == 100.0
    assert table["babilong:2:2k"]["ilcp"]["same as prompt_tuned"] == 0.0
    assert table["babilong:2:2k"]["prompt_tuned"]["gold"] == 0.0
    assert table["babi:2"]["ilcp"] == {"n": 1, "gold": 0.0, "story location": 0.0,
                                       "some person's last location": 0.0, "one word": 100.0}
    assert "| babilong:2:2k | `ilcp` | 1 | 100 |" in capsys.readouterr().out


def test_a_missing_file_or_a_foreign_row_id_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        sources.main([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="not a row of"):
        sources.story_of("babilong-qa1-2k-test-s0-q0", "babilong:2:2k", {})
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"task": "babilong:2:2k", "id": "babilong-qa1-2k-test-s0-q0", "method": "ilcp",
                                   "answer": "x", "prediction": "x"}) + "\n")
    with pytest.raises(SystemExit):  # a usage error, not a traceback
        sources.main([str(foreign)])

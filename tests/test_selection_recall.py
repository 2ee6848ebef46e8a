"""benchmarks/selection_recall.py: the gold sentence is found where the answer is read from, and
the recall counts what each selector keeps (everything at r1, nothing of it at one row)."""

import argparse

import pytest
from _benchmarks import load_benchmark

from ilcp import rclc
from ilcp.rclc.selectors.sentences import Sentences
from ilcp.tasks import make_facts

recall = load_benchmark("selection_recall")


def _gold(lm, context, question, answer, task):
    state = rclc.sender_from_hf(lm.model, lm.tokenizer, " " + context)
    ids = state.token_ids.tolist()
    gold = recall.find_gold(lm.tokenizer, ids, Sentences().spans(state), question, answer, task)
    return gold, (lambda positions: lm.tokenizer.decode([ids[p] for p in positions]))


def test_the_entity_is_the_person_or_the_named_thing():
    assert recall.entity_of("Where is Mary?", "babi:1") == "Mary"
    assert recall.entity_of("Where is the football?", "babi:1") is None
    assert recall.entity_of("Who owns Larchridge?", "facts") == "Larchridge"
    assert recall.entity_of("In which city is Kingfisherbrook based?", "facts") == "Kingfisherbrook"


def test_babi_gold_is_the_persons_latest_sentence(tiny_lm):
    context = "Mary moved to the hallway. John went to the office. Mary travelled to the office. John moved to the hallway."
    gold, text = _gold(tiny_lm, context, "Where is Mary?", "office", "babi:1")
    assert text(gold.sentence).strip() == "Mary travelled to the office."
    assert text(gold.answer).strip() == "office"


def test_facts_gold_names_the_entity_and_holds_the_answer(tiny_lm):
    for row in make_facts(6, split="validation", value_split="train").to_list():
        gold, text = _gold(tiny_lm, row["context"], row["question"], row["answer"], "facts")
        assert gold is not None, row
        sentence = text(gold.sentence)
        assert recall.entity_of(row["question"], "facts") in sentence and row["answer"] in sentence
        assert row["answer"] in text(gold.answer) and sentence.strip() in row["context"]


def test_recall_is_whole_at_r1_and_none_at_one_row(tiny_lm):
    rows = make_facts(4, split="validation", value_split="train").to_list()
    report = recall.measure(tiny_lm, rows, "facts", ["cacheback", "sentences"], ["r1", "b1", "r4"])
    assert (report["questions"], report["skipped"]) == (4, 0)
    for per in report["results"].values():
        assert per["r1"]["sentence"] == per["r1"]["answer"] == 1.0
        assert per["b1"] == {"sentence": 0.0, "answer": 0.0, "rows": 1.0}  # position 0 only
        assert 1.0 < per["r4"]["rows"] < per["r1"]["rows"]
    assert "| cacheback | 100 / 100" in recall.markdown(report, ["r1", "b1", "r4"])


def test_budgets_parse_or_fail_clearly():
    assert recall.parse_budget("r4") == {"ratio": 4} and recall.parse_budget("b16") == {"budget": 16}
    for bad in ("r0", "x4", "4", "b-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="r<N>"):
            recall.parse_budget(bad)


@pytest.mark.parametrize("argv, message", [
    (["--selectors", "nope"], "unknown selector"),
    (["--budgets", "r4,q2"], "r<N>"),
    (["--limit", "0"], "--limit"),
])
def test_the_command_line_refuses_bad_arguments_before_loading_a_model(argv, message, capsys):
    with pytest.raises(SystemExit):
        recall.main(argv)
    assert message in capsys.readouterr().err

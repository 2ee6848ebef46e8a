"""ilcp.tasks: the bAbI reader on the vendored files, the procedural facts task, the registry."""

import json
import re
import shutil

import pytest

from ilcp import tasks
from ilcp.tasks import (
    ALL_ENTITIES,
    FACT_ATTRIBUTES,
    TASK_COLUMNS,
    TaskFormatError,
    count_tokens,
    facts_for_length,
    load_babi,
    load_task,
    make_facts,
    task_config_key,
)

QUESTION_FORMS = {  # question regex -> attribute
    re.escape(spec.question).replace(re.escape("{entity}"), "(?P<entity>\\w+)") + "$": attribute
    for attribute, spec in FACT_ATTRIBUTES.items()
}


def _asked(row):
    """(entity, attribute) the row's question asks about."""
    for pattern, attribute in QUESTION_FORMS.items():
        match = re.match(pattern, row["question"])
        if match:
            return match.group("entity"), attribute
    raise AssertionError(f"unrecognised question {row['question']!r}")


def _story(row_id):
    return re.search(r"-s(\d+)-q\d+$", row_id).group(1)


# ----------------------------------------------------------------------------------------- bAbI

@pytest.mark.parametrize("task", [1, 2, 3, 6, 8, 19, 20])
def test_babi_test_files_have_1000_wellformed_questions(task):
    rows = load_babi(task, "test")
    assert rows.column_names == list(TASK_COLUMNS)
    assert len(rows) == 1000
    assert len(set(rows["id"])) == 1000
    assert set(rows["task"]) == {f"babi-qa{task}"}
    assert all(answer.strip() == answer and answer for answer in rows["answer"])
    assert all(question.strip() == question and question for question in rows["question"])
    assert not any("?" in context or "\t" in context for context in rows["context"])


def test_babi_first_rows_match_the_file():
    rows = load_babi("qa1", "test")
    assert rows[0] == {"id": "babi-qa1-test-s0-q0", "task": "babi-qa1",
                       "context": "John travelled to the hallway. Mary journeyed to the bathroom.",
                       "question": "Where is John?", "answer": "hallway"}
    assert rows[1]["context"].startswith(rows[0]["context"] + " ")
    assert rows[1]["id"] == "babi-qa1-test-s0-q1"
    lists = load_babi(8, "test")["answer"]
    paths = load_babi(19, "test")["answer"]
    assert any("," in a for a in lists) and all(re.fullmatch(r"[nsew],[nsew]", a) for a in paths)


def test_task_spellings_agree():
    reference = load_babi(2, "test", limit=5)
    for spelling in ("2", "qa2", "babi-qa2", "babi:2", "QA2"):
        assert load_babi(spelling, "test", limit=5).to_dict() == reference.to_dict()


def test_en10k_train_and_validation_cover_the_file_by_whole_stories():
    train = load_babi(1, "train", variant="en-10k")
    validation = load_babi(1, "validation", variant="en-10k")
    assert len(train) + len(validation) == 10_000
    assert 800 <= len(validation) <= 1200
    assert train[0]["id"].startswith("babi-qa1-en10k-train-")
    assert not {_story(i) for i in train["id"]} & {_story(i) for i in validation["id"]}
    again = load_babi(1, "validation", variant="en-10k")
    assert again["id"] == validation["id"]
    other_seed = load_babi(1, "validation", variant="en-10k", seed=1)
    assert other_seed["id"] != validation["id"]


def test_train_plus_validation_is_the_whole_train_file():
    train, validation = load_babi(6, "train"), load_babi(6, "validation")
    combined = sorted(
        list(zip(train["id"], train["context"], train["question"], train["answer"]))
        + list(zip(validation["id"], validation["context"], validation["question"],
                   validation["answer"])),
        key=lambda row: (int(_story(row[0])), int(row[0].rsplit("-q", 1)[1])))
    stories = tasks.parse_babi_file(tasks.babi_file(6, "train"))
    expected = [triple for story in stories for triple in story]
    assert [row[1:] for row in combined] == expected
    assert len(expected) == 1000
    assert len(load_babi(6, "train", validation_fraction=0.0)) == 1000


def test_limit_takes_the_first_rows():
    full = load_babi(3, "train")
    assert load_babi(3, "train", limit=7)["id"] == full["id"][:7]
    assert len(load_babi(3, "train", limit=0)) == 0
    with pytest.raises(ValueError):
        load_babi(3, "train", limit=-1)


def test_babi_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="split"):
        load_babi(1, "dev")
    with pytest.raises(ValueError, match="en-10k"):  # names the available variants
        load_babi(1, "test", variant="hn")
    with pytest.raises(ValueError, match="task"):
        load_babi("qa-one", "test")
    with pytest.raises(ValueError, match="validation_fraction"):
        load_babi(1, "train", validation_fraction=1.0)
    with pytest.raises(FileNotFoundError, match=r"qa4_\*_test\.txt"):  # not vendored, on purpose
        load_babi(4, "test")
    with pytest.raises(FileNotFoundError, match="ILCP_BABI_DIR"):
        load_babi(1, "test", data_dir=tmp_path / "nowhere")


def _write_task(root, lines, number=4, split="test"):
    folder = root / "en"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"qa{number}_made-up_{split}.txt"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_reads_any_task_file_in_the_format(tmp_path, monkeypatch):
    _write_task(tmp_path, ["1 The hall is north of the den.",
                           "2 What is north of the den?\thall\t1",
                           "1 Bob is here.", "3 Where is Bob?\there\t1"])
    monkeypatch.setenv("ILCP_BABI_DIR", str(tmp_path))
    rows = load_babi(4, "test")
    assert rows["id"] == ["babi-qa4-test-s0-q0", "babi-qa4-test-s1-q0"]
    assert rows["context"] == ["The hall is north of the den.", "Bob is here."]
    assert rows["answer"] == ["hall", "here"]


@pytest.mark.parametrize("lines, line_no, what", [
    (["1 A is here.", "Where is A?\there\t1"], 2, "integer ID"),
    (["1 A is here.", "2 Where is A?\there"], 2, "3 tab-separated fields"),
    (["1 A is here.", "2 Where is A?\there\t1\textra"], 2, "3 tab-separated fields"),
    (["1 A is here.", "2 B is there.", "3 Where is A?\t \t1"], 3, "empty answer"),
    (["1 A is here.", "3 B is there.", "2 Where is A?\there\t1"], 3, "does not increase"),
    (["1 A is here.", "2 Where is A?\there\t1", "2 B is there."], 3, "does not increase"),
    (["2 A is here.", "3 Where is A?\there\t2"], 1, "start with ID 1"),
    (["1 A is here.", "2 Where is A?\there\tone"], 2, "supporting IDs"),
])
def test_malformed_lines_name_file_and_line(tmp_path, lines, line_no, what):
    path = _write_task(tmp_path, lines)
    with pytest.raises(TaskFormatError, match=what) as caught:
        load_babi(4, "test", data_dir=tmp_path)
    assert str(path) in str(caught.value)
    assert f"line {line_no}:" in str(caught.value)
    assert isinstance(caught.value, ValueError)


# ---------------------------------------------------------------------------------------- facts

def test_facts_are_deterministic_and_seeded():
    first = make_facts(30, n_facts=5, n_distractors=10, seed=3)
    assert first.column_names == list(TASK_COLUMNS)
    assert first.to_dict() == make_facts(30, n_facts=5, n_distractors=10, seed=3).to_dict()
    assert first["context"] != make_facts(30, n_facts=5, n_distractors=10, seed=4)["context"]
    assert first["context"] != make_facts(30, n_facts=5, n_distractors=10, seed=3,
                                          split="test")["context"]
    assert make_facts(10, n_facts=5, n_distractors=10, seed=3).to_dict() == first[:10]
    assert first[17]["id"] == "facts-f5-d10-train-17" and set(first["task"]) == {"facts"}
    assert len(set(first["id"])) == 30


@pytest.mark.parametrize("n_facts, n_distractors", [(1, 0), (4, 0), (6, 30), (16, 200)])
def test_each_question_has_one_stated_answer(n_facts, n_distractors):
    rows = make_facts(40, n_facts=n_facts, n_distractors=n_distractors, seed=1, split="validation")
    for row in rows:
        entity, attribute = _asked(row)
        spec = FACT_ATTRIBUTES[attribute]
        assert row["answer"] in spec.values and " " not in row["answer"]
        sentence = spec.statement.format(entity=entity, value=row["answer"])
        assert row["context"].count(sentence) == 1
        # no other value for the same entity and attribute anywhere in the context
        any_value = re.escape(spec.statement).replace(re.escape("{entity}"), re.escape(entity))
        any_value = r"(?<!\w)" + any_value.replace(re.escape("{value}"), r"\w+")
        assert len(re.findall(any_value, row["context"])) == 1
        statements = re.findall(r"[^.]+\.", row["context"])
        assert len(statements) == n_facts + n_distractors
        assert len(set(statements)) == len(statements)


def test_splits_never_ask_the_same_fact():
    def asked(split):
        return {(*_asked(r), r["answer"]) for r in make_facts(300, n_facts=1, split=split)}
    train, validation, test = asked("train"), asked("validation"), asked("test")
    assert not train & test and not train & validation and not validation & test


def test_entity_names_are_unambiguous():
    values = {v for spec in FACT_ATTRIBUTES.values() for v in spec.values}
    assert len(set(ALL_ENTITIES)) == len(ALL_ENTITIES)
    assert not {e.lower() for e in ALL_ENTITIES} & {v.lower() for v in values}


def test_length_dial():
    def mean_words(**kwargs):
        rows = make_facts(20, seed=5, **kwargs)
        return sum(count_tokens(c) for c in rows["context"]) / len(rows)
    short, more_facts = mean_words(n_facts=2), mean_words(n_facts=8)
    more_distractors = mean_words(n_facts=8, n_distractors=40)
    assert short <= 20 < more_facts < more_distractors
    assert max(count_tokens(c) for c in make_facts(50, n_facts=4)["context"]) <= 80

    setting = facts_for_length(2500)
    rows = make_facts(20, **setting)
    lengths = [count_tokens(c) for c in rows["context"]]
    assert min(lengths) >= 2000 and abs(sum(lengths) / len(lengths) - 2500) < 250
    assert facts_for_length(10) == {"n_facts": 4, "n_distractors": 0}


def test_length_dial_with_the_tiny_tokenizer():
    from ilcp.lm import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    short = make_facts(20, n_facts=3)
    assert max(count_tokens(c, tokenizer) for c in short["context"]) <= 80
    rows = make_facts(10, **facts_for_length(2300, tokenizer))
    lengths = [count_tokens(c, tokenizer) for c in rows["context"]]
    assert min(lengths) >= 2000 and abs(sum(lengths) / len(lengths) - 2300) < 230


@pytest.mark.parametrize("kwargs", [
    {"n_examples": -1}, {"n_examples": 5, "n_facts": 0}, {"n_examples": 5, "n_distractors": -2},
    {"n_examples": 5, "split": "dev"}, {"n_examples": 5, "n_facts": 2.5},
])
def test_facts_bad_arguments(kwargs):
    n_examples = kwargs.pop("n_examples")
    with pytest.raises(ValueError):
        make_facts(n_examples, **kwargs)


def test_facts_for_length_rejects_bad_target():
    with pytest.raises(ValueError):
        facts_for_length(0)


# ------------------------------------------------------------------------------------- registry

def test_load_task_registry():
    babi = load_task("babi-qa2", "test", limit=3)
    assert babi.to_dict() == load_babi(2, "test", limit=3).to_dict()
    assert load_task("babi:1", "validation", variant="en-10k", limit=4)["id"] == \
        load_babi(1, "validation", variant="en-10k", limit=4)["id"]
    facts = load_task("facts", "test", n_examples=6, n_facts=3, n_distractors=2, seed=2)
    assert facts.to_dict() == make_facts(6, n_facts=3, n_distractors=2, seed=2,
                                         split="test").to_dict()
    assert len(load_task("facts", "train", n_examples=6, limit=2)) == 2
    with pytest.raises(ValueError, match="facts"):
        load_task("squad", "train")
    with pytest.raises(ValueError, match="n_examples"):
        load_task("facts", "train")


def test_task_config_key(tmp_path):
    key = task_config_key("babi-qa1", "train")
    assert json.loads(json.dumps(key)) == key
    assert key["task"] == "babi-qa1" and key["source"].startswith("qa1_")
    assert re.fullmatch(r"[0-9a-f]{16}", key["source_sha256"])
    assert task_config_key("babi:1", "train") == key
    assert task_config_key("babi-qa1", "train", limit=5) != key
    assert task_config_key("babi-qa1", "validation") != key
    assert task_config_key("babi-qa1", "train", variant="en-10k") != key
    assert task_config_key("babi-qa1", "test")["source_sha256"] != key["source_sha256"]

    # same content elsewhere -> same key; changed content -> a different key
    copy = tmp_path / "en" / tasks.babi_file(1, "train").name
    copy.parent.mkdir()
    shutil.copy(tasks.babi_file(1, "train"), copy)
    assert task_config_key("babi-qa1", "train", data_dir=tmp_path) == key
    copy.write_text(copy.read_text().replace("hallway", "corridor"))
    assert task_config_key("babi-qa1", "train", data_dir=tmp_path) != key

    facts = task_config_key("facts", "train", n_examples=100, n_facts=4)
    assert json.loads(json.dumps(facts)) == facts
    assert facts["n_distractors"] == 0 and facts["seed"] == 0
    assert task_config_key("facts", "train", n_examples=100, n_facts=5) != facts
    assert task_config_key("facts", "train", n_examples=100, n_facts=4, n_distractors=1) != facts
    assert task_config_key("facts", "test", n_examples=100, n_facts=4) != facts
    assert task_config_key("facts", "train", n_examples=100, n_facts=4, seed=1) != facts

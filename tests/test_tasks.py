"""ilcp.tasks: the bAbI reader on the vendored files, bAbI mixes and stories, the procedural facts
task with its held-out value split and unlabelled contexts, the registry."""

import hashlib
from pathlib import Path
import json
import os
import re
import shutil
import time

import pytest

from ilcp import tasks
from ilcp.tasks import fact_vocabulary
from ilcp.tasks import (
    ALL_ENTITIES,
    FACT_ATTRIBUTES,
    TASK_COLUMNS,
    TaskFormatError,
    babi_stories,
    count_tokens,
    fact_values,
    facts_contexts,
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
                       "question": "Where is John?", "answer": "hallway", "answers": ["hallway"]}
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
    with pytest.raises(FileNotFoundError, match="point data_dir= at"):  # the argument the caller passed
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
        load_task("trivia", "train")
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


# --------------------------------------------------------------- unchanged defaults (reference)

def _digest(dataset):
    """The rows' digest without ``answers`` (added later: ``[answer]`` for every generated row)."""
    rows = dataset.to_dict()
    assert rows.pop("answers") == [[answer] for answer in rows["answer"]]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


# Digests of the rows these calls gave before held-out values, mixes and stories were added.
@pytest.mark.parametrize("n_examples, kwargs, digest", [
    (300, {"n_facts": 4}, "3af05ff482665e76"),
    (300, {"n_facts": 1, "split": "test"}, "181dba4ed2faaa3f"),
    (200, {"n_facts": 6, "n_distractors": 30, "seed": 3, "split": "validation"},
     "0d697461fae5a186"),
    (20, {"n_facts": 16, "n_distractors": 200, "seed": 1}, "28418d7d7b502033"),
])
def test_default_facts_rows_are_unchanged(n_examples, kwargs, digest):
    assert _digest(make_facts(n_examples, **kwargs)) == digest
    assert _digest(make_facts(n_examples, value_split=None, **kwargs)) == digest


def test_default_babi_rows_and_keys_are_unchanged():
    assert _digest(load_task("babi:2", "train", limit=50)) == "9bb0eb32d323310a"
    assert _digest(load_task("babi-qa1", "validation", variant="en-10k")) == "0d6731bc67374c05"
    assert task_config_key("facts", "train", n_examples=100, n_facts=4) == {
        "task": "facts", "n_examples": 100, "n_facts": 4, "n_distractors": 0, "seed": 0,
        "split": "train", "generator_version": 1}
    assert task_config_key("babi:1", "train", variant="en-10k", limit=5) == {
        "task": "babi-qa1", "split": "train", "variant": "en-10k", "limit": 5,
        "validation_fraction": 0.1, "seed": 0, "source": "qa1_single-supporting-fact_train.txt",
        "source_sha256": "749ea9f7c99070fe"}
    assert task_config_key("babi:3", "test") == {
        "task": "babi-qa3", "split": "test", "variant": "en", "limit": None,
        "source": "qa3_three-supporting-facts_test.txt", "source_sha256": "17795c977100baf8"}
    assert facts_for_length(500) == {"n_facts": 4, "n_distractors": 86}


# ---------------------------------------------------------------------- held-out value split

def _words(texts):
    return {word for text in texts for word in re.findall(r"\w+", text)}


def test_value_vocabularies_are_large_disjoint_and_partitioned():
    vocabularies = tasks.FACT_VOCABULARIES
    for attribute, spec in FACT_ATTRIBUTES.items():  # the original values are all kept
        assert set(spec.values) <= set(fact_values(attribute))
    lowered = [v.lower() for values in vocabularies.values() for v in values]
    assert len(set(lowered)) == len(lowered)
    assert all(re.fullmatch(r"[A-Za-z0-9]+", v) for v in lowered)
    assert not set(lowered) & {e.lower() for e in ALL_ENTITIES}
    template_words = {w.lower() for w in _words(
        [*fact_vocabulary.FILLERS, *fact_vocabulary.WEATHER,
         *(spec.statement + " " + spec.question for spec in FACT_ATTRIBUTES.values())])}
    assert not set(lowered) & template_words
    for name, values in vocabularies.items():
        train, heldout = fact_values(name, "train"), fact_values(name, "heldout")
        assert not set(train) & set(heldout) and set(train) | set(heldout) == set(values)
        assert 0.2 <= len(heldout) / len(values) <= 0.3
        assert len(heldout) >= 15
    assert len(vocabularies["person"]) >= 250 and len(vocabularies["city"]) >= 200
    assert fact_values("owner", "heldout") == fact_values("person", "heldout")
    with pytest.raises(ValueError, match="vocabulary"):
        fact_values("shoe")
    with pytest.raises(ValueError, match="value_split"):
        fact_values("person", "test")


@pytest.fixture(scope="module")
def value_split_rows():
    settings = {"n_facts": 6, "n_distractors": 10, "seed": 2}
    return {
        "train": make_facts(3000, split="train", value_split="train", **settings),
        "validation": make_facts(500, split="validation", value_split="train", **settings),
        "test": make_facts(500, split="test", value_split="train", **settings),
        "heldout": load_task("facts", "test", n_examples=1000, value_split="heldout", **settings),
    }


def test_heldout_answers_never_occur_in_training(value_split_rows):
    heldout_values = {v for name in tasks.FACT_VOCABULARIES for v in fact_values(name, "heldout")}
    train_values = {v for name in tasks.FACT_VOCABULARIES for v in fact_values(name, "train")}
    seen = [value_split_rows[split] for split in ("train", "validation", "test")]
    heldout = value_split_rows["heldout"]
    seen_answers = {a for rows in seen for a in rows["answer"]}
    assert set(heldout["answer"]) <= heldout_values
    assert not seen_answers & set(heldout["answer"])
    assert seen_answers <= train_values
    # no held-out value anywhere in the contexts (or questions) made with train values ...
    assert not _words(c for rows in seen for c in [*rows["context"], *rows["question"]]) \
        & heldout_values
    # ... and the held-out contexts hold held-out values only, so novelty singles out nothing
    assert not _words(heldout["context"]) & train_values
    assert len(set(heldout["answer"])) > 150
    assert heldout[0]["id"] == "facts-f6-d10-heldoutvalues-test-0"
    assert value_split_rows["train"][5]["id"] == "facts-f6-d10-trainvalues-train-5"


def test_value_split_rows_never_repeat_within_or_across_splits(value_split_rows):
    pairs = [list(zip(rows["context"], rows["question"])) for rows in value_split_rows.values()]
    flat = [pair for group in pairs for pair in group]
    assert len(set(flat)) == len(flat)
    asked = {split: {(*_asked(r), r["answer"]) for r in rows}
             for split, rows in value_split_rows.items()}
    assert not asked["train"] & asked["validation"] and not asked["train"] & asked["test"]
    assert not asked["validation"] & asked["test"]


@pytest.mark.parametrize("n_facts, n_distractors, value_split, split", [
    (1, 0, "train", "train"), (4, 0, "heldout", "test"), (6, 30, "train", "validation"),
    (16, 200, "heldout", "test")])
def test_value_split_questions_have_one_stated_answer(n_facts, n_distractors, value_split, split):
    rows = make_facts(40, n_facts=n_facts, n_distractors=n_distractors, seed=1, split=split,
                      value_split=value_split)
    for row in rows:
        entity, attribute = _asked(row)
        spec = FACT_ATTRIBUTES[attribute]
        assert row["answer"] in fact_values(attribute, value_split)
        assert row["context"].count(spec.statement.format(entity=entity, value=row["answer"])) == 1
        any_value = re.escape(spec.statement).replace(re.escape("{entity}"), re.escape(entity))
        any_value = r"(?<!\w)" + any_value.replace(re.escape("{value}"), r"\w+")
        assert len(re.findall(any_value, row["context"])) == 1
        statements = re.findall(r"[^.]+\.", row["context"])
        assert len(statements) == n_facts + n_distractors
        assert len(set(statements)) == len(statements)


def test_value_split_is_deterministic_and_seeded():
    first = make_facts(50, n_facts=3, seed=4, value_split="train")
    assert first.to_dict() == make_facts(50, n_facts=3, seed=4, value_split="train").to_dict()
    assert make_facts(20, n_facts=3, seed=4, value_split="train").to_dict() == first[:20]
    assert first["context"] != make_facts(50, n_facts=3, seed=5, value_split="train")["context"]
    heldout = make_facts(50, n_facts=3, seed=4, split="test", value_split="heldout")
    assert heldout.to_dict() == make_facts(50, n_facts=3, seed=4, split="test",
                                           value_split="heldout").to_dict()


def test_fifty_thousand_distinct_training_rows_quickly():
    start = time.perf_counter()
    rows = make_facts(50_000, n_facts=1, value_split="train")
    elapsed = time.perf_counter() - start
    assert len(rows) == 50_000 and len(set(rows["id"])) == 50_000
    assert len(set(zip(rows["context"], rows["question"]))) == 50_000
    assert elapsed < 60, f"50k facts rows took {elapsed:.1f} s"


def test_value_split_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="only for the test split"):
        make_facts(5, split="train", value_split="heldout")
    with pytest.raises(ValueError, match="only for the test split"):
        load_task("facts", "validation", n_examples=5, value_split="heldout")
    with pytest.raises(ValueError, match="value_split"):
        make_facts(5, value_split="test")
    with pytest.raises(ValueError, match="value_split"):
        task_config_key("facts", "train", n_examples=5, value_split="all")
    monkeypatch.setattr(tasks.facts, "ALL_ENTITIES", ("Cedar", "Birch"))  # a space of a few hundred
    with pytest.raises(ValueError, match="distinct"):
        make_facts(2000, n_facts=1, split="test", value_split="heldout")


def test_value_split_config_keys():
    plain = task_config_key("facts", "test", n_examples=100)
    train = task_config_key("facts", "test", n_examples=100, value_split="train")
    heldout = task_config_key("facts", "test", n_examples=100, value_split="heldout")
    assert json.loads(json.dumps(heldout)) == heldout
    assert len({json.dumps(k, sort_keys=True) for k in (plain, train, heldout)}) == 3
    assert "value_split" not in plain
    assert heldout["value_split"] == "heldout" and heldout["value_split_version"] == 1


# ----------------------------------------------------------------------- unlabelled contexts

def test_facts_contexts():
    contexts = facts_contexts(2000, 3, n_facts_range=(2, 5))
    assert len(contexts) == 2000 and len(set(contexts)) == 2000
    assert all(isinstance(c, str) and "?" not in c for c in contexts)
    assert {len(re.findall(r"[^.]+\.", c)) for c in contexts} == {2, 3, 4, 5}
    assert contexts == facts_contexts(2000, 3, n_facts_range=(2, 5))
    assert contexts[:100] == facts_contexts(100, 3, n_facts_range=(2, 5))
    assert contexts[:100] != facts_contexts(100, 4, n_facts_range=(2, 5))
    heldout_values = {v for name in tasks.FACT_VOCABULARIES for v in fact_values(name, "heldout")}
    assert not _words(contexts) & heldout_values
    with_distractors = facts_contexts(50, 0, n_facts_range=(1, 1), n_distractors_range=(3, 3))
    assert {len(re.findall(r"[^.]+\.", c)) for c in with_distractors} == {4}
    unseen = facts_contexts(200, 0, value_split="heldout")
    assert _words(unseen) & heldout_values and not _words(unseen) & (
        {v for name in tasks.FACT_VOCABULARIES for v in fact_values(name, "train")})
    for bad in [{"n_facts_range": (0, 3)}, {"n_facts_range": (4, 2)}, {"n_facts_range": 3},
                {"value_split": None}, {"n_distractors_range": (-1, 2)}]:
        with pytest.raises(ValueError):
            facts_contexts(5, 0, **bad)
    with pytest.raises(ValueError):
        facts_contexts(-1, 0)


def test_babi_stories():
    stories = babi_stories(1)
    rows = load_babi(1, "train")
    assert len(stories) == len(set(stories)) and 100 < len(stories) <= 180
    assert not any("?" in s or "\t" in s for s in stories)
    full = set()  # each story's text is the context of its last question
    for row, following in zip(rows, [*rows["id"][1:], None]):
        if following is None or _story(following) != _story(row["id"]):
            full.add(row["context"])
    assert set(stories) == full
    validation = babi_stories("babi:1", "en", "validation")
    assert validation and not set(validation) & set(stories)
    assert set(babi_stories(1, prefixes=True)) == set(rows["context"])
    mixed = babi_stories("1+2+3")
    assert set(mixed) == set(stories) | set(babi_stories(2)) | set(babi_stories(3))
    assert mixed == babi_stories(["qa3", 2, "babi:1"]) and len(mixed) == len(set(mixed))
    assert len(babi_stories(1, "en-10k")) > 1000
    with pytest.raises(ValueError):
        babi_stories("1+1")


# ----------------------------------------------------------------------------------- bAbI mix

def test_babi_mix_interleaves_whole_tasks():
    mixed = load_task("babi:1+2+3", "train")
    singles = {n: load_babi(n, "train").to_list() for n in (1, 2, 3)}
    assert mixed.column_names == list(TASK_COLUMNS)
    assert len(mixed) == sum(len(rows) for rows in singles.values())
    for n, rows in singles.items():  # each task's rows, in their order
        assert [r for r in mixed if r["task"] == f"babi-qa{n}"] == rows
    first = mixed["task"][:30]
    assert all(first.count(f"babi-qa{n}") == 10 for n in (1, 2, 3))
    assert len(set(mixed["id"])) == len(mixed)
    assert load_task("babi:1+2+3", "train", limit=30).to_dict() == mixed[:30]
    for spelling in ("babi:3+1+2", "babi-qa1+qa2+qa3", "babi:1+babi:2+babi:3",
                     ["babi:1", "qa2", 3]):
        assert load_task(spelling, "train", limit=40)["id"] == mixed["id"][:40]
    assert load_task(["babi:2"], "test", limit=5).to_dict() == load_babi(2, "test",
                                                                           limit=5).to_dict()


def test_babi_mix_validation_is_carved_by_whole_stories():
    train = load_task("babi:1+6", "train", seed=3)
    validation = load_task("babi:1+6", "validation", seed=3)
    for n in (1, 6):
        t = {_story(i) for i, task in zip(train["id"], train["task"]) if task == f"babi-qa{n}"}
        v = {_story(i) for i, task in zip(validation["id"], validation["task"])
             if task == f"babi-qa{n}"}
        assert t and v and not t & v
        assert validation.filter(lambda r, n=n: r["task"] == f"babi-qa{n}")["id"] == \
            load_babi(n, "validation", seed=3)["id"]
    assert len(train) + len(validation) == 2000
    assert set(load_task("babi:1+6", "test")["task"]) == {"babi-qa1", "babi-qa6"}


def test_babi_mix_config_keys_and_errors():
    key = task_config_key("babi:1+2", "train")
    assert json.loads(json.dumps(key)) == key
    assert key["task"] == "babi-qa1+qa2" and len(key["source"]) == len(key["source_sha256"]) == 2
    assert task_config_key("babi:2+1", "train") == key
    assert task_config_key(["qa1", "babi:2"], "train") == key
    others = [task_config_key(name, "train") for name in ("babi:1", "babi:1+3", "babi:1+2+3")]
    others.append(task_config_key("babi:1+2", "validation"))
    others.append(task_config_key("babi:1+2", "train", seed=1))
    assert all(other != key for other in others)
    assert "seed" not in task_config_key("babi:1+2", "test")
    with pytest.raises(ValueError, match="twice"):
        load_task("babi:1+1", "train")
    with pytest.raises(ValueError):
        load_task("babi:1+", "train")
    with pytest.raises(ValueError):
        load_task(["facts", "babi:1"], "train")
    with pytest.raises(FileNotFoundError):
        load_task("babi:1+4", "test")


def test_shipped_data_lives_in_the_top_level_folder_and_installs_as_package_data():
    import fnmatch
    import tomllib

    import ilcp
    from ilcp.datadir import data_root
    from ilcp.tasks import default_babi_dir

    repo = Path(ilcp.__file__).parent.parent
    assert data_root() == repo / "data" and default_babi_dir() == repo / "data" / "babi"
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = sorted(".".join(p.parent.relative_to(repo).parts) for p in (repo / "ilcp").rglob("__init__.py"))
    assert sorted(setuptools["packages"]) == sorted([*packages, "ilcp.data"])
    assert setuptools["package-dir"] == {"ilcp.data": "data"}
    patterns = setuptools["package-data"]["ilcp.data"]
    files = [p.relative_to(repo / "data").as_posix() for p in (repo / "data").rglob("*")
             if p.is_file() and "cache" not in p.relative_to(repo / "data").parts]
    unshipped = [f for f in files if not any(fnmatch.fnmatchcase(f, pat) and f.count("/") == pat.count("/")
                                             for pat in patterns)]
    assert files and unshipped == []


@pytest.mark.slow
def test_an_installed_wheel_finds_its_built_in_tasks(tmp_path):
    """A wheel built from the checkout carries data/ as ilcp/data, and the installed package (not
    the checkout) reads its bAbI and SQuAD rows from there."""
    import subprocess
    import sys
    import zipfile

    import ilcp

    repo = Path(ilcp.__file__).parent.parent
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(repo), "--no-deps", "-q", "-w", str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("ilcp-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "ilcp" / "data" / "babi" / "en-10k" / "qa1_single-supporting-fact_train.txt").is_file()
    probe = ("import ilcp, json; from ilcp.datadir import data_root; from ilcp.tasks import load_task; "
             "print(json.dumps([ilcp.__file__, str(data_root()), len(load_task('babi:1', 'test', limit=3)), "
             "len(load_task('squad', 'test', limit=3))]))")
    env = {k: v for k, v in os.environ.items() if k not in ("ILCP_DATA_DIR", "ILCP_BABI_DIR")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**env, "PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr[-2000:]
    module, root, n_babi, n_squad = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(module).is_relative_to(site) and Path(root) == site / "ilcp" / "data"
    assert (n_babi, n_squad) == (3, 3)

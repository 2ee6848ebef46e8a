"""File tasks (``jsonl:``, ``csv:``, ``parquet:``, ``disk:``): every format gives the same rows,
answers and column names, the carved splits, the cache key, the one-line errors (through the API
and through ``ilcp-train``); the balanced ``babi:all``; SQuAD scoring against hand-computed
values of the official v1.1 script; the shipped ``squad`` task.

Every file is written under the test's tmp_path; `datasets`' Arrow cache goes to a temporary
folder too, so the user's ~/.cache is left alone.
"""

import hashlib
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import datasets
import pytest

from ilcp import cli
from ilcp.evaluation.report import accuracy_summary
from ilcp.metrics import exact_match, squad_scores
from ilcp.tasks import SPLITS, TASK_COLUMNS, TaskFormatError, load_task, resolve_task, task_config_key

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
SHIPPED_BABI = (1, 2, 3, 6, 7, 8, 9, 10, 11, 15, 16, 17, 18, 19, 20)


@pytest.fixture(autouse=True, scope="module")
def _datasets_cache(tmp_path_factory):
    """`datasets` writes an Arrow cache for every file it reads: keep it out of the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))
        yield


# ----------------------------------------------------------------------------------- helpers

def make_rows(n_contexts: int, per_context: int = 2, *, ids: bool = True) -> list[dict]:
    """``per_context`` questions about each of ``n_contexts`` distinct contexts (string answers)."""
    rows = []
    for c in range(n_contexts):
        items = " and ".join(f"item {c}-{q} on shelf {q}" for q in range(per_context))
        context = f"Story {c}: box {c} holds {items}."
        for q in range(per_context):
            row = {"context": context, "question": f"What does box {c} hold on shelf {q}?", "answer": f"item {c}-{q}"}
            rows.append({"id": f"r{c}-{q}", **row} if ids else row)
    return rows


# 12 contexts, 2 questions each; the splits a source may give: contexts 0-7 / 8-9 / 10-11.
ROWS = make_rows(12)
GIVEN = {"train": ROWS[:16], "validation": ROWS[16:20], "test": ROWS[20:]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write(fmt: str, path: Path, rows: list[dict]) -> Path:
    """``rows`` as one file (or save_to_disk folder) of a format, through `datasets`."""
    ds = datasets.Dataset.from_list(rows)
    {"jsonl": ds.to_json, "csv": ds.to_csv, "parquet": ds.to_parquet, "disk": ds.save_to_disk}[fmt](str(path))
    return path


def seen(ds) -> list[tuple]:
    """What a format must agree on: (id, context, question, answers) of each row, in order."""
    return [(r["id"], r["context"], r["question"], tuple(r["answers"])) for r in ds.to_list()]


def expected(rows: list[dict]) -> list[tuple]:
    return [(r["id"], r["context"], r["question"], (r["answer"],)) for r in rows]


def all_splits(name: str, **kwargs) -> dict[str, list[dict]]:
    return {split: load_task(name, split, **kwargs).to_list() for split in SPLITS}


def contexts(rows) -> set[str]:
    return {r["context"] for r in rows}


def listing(root: Path) -> dict[str, str]:
    """Every file (its sha256) and folder ("/") under root."""
    return {str(p): "/" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


# ------------------------------------------------------------------------ 1. formats and splits

def test_single_file_formats_give_the_same_rows(tmp_path):
    names = {
        "jsonl": f"jsonl:{write('jsonl', tmp_path / 'rows.jsonl', ROWS)}",
        "csv": f"csv:{write('csv', tmp_path / 'rows.csv', ROWS)}",
        "parquet": f"parquet:{write('parquet', tmp_path / 'rows.parquet', ROWS)}",
        "disk": f"disk:{write('disk', tmp_path / 'rows_disk', ROWS)}",
    }
    loaded = {fmt: {split: seen(load_task(name, split)) for split in SPLITS} for fmt, name in names.items()}
    reference = loaded["jsonl"]
    for fmt, splits in loaded.items():
        assert splits == reference, fmt
    assert all(reference[split] for split in SPLITS)
    assert sorted(row for split in SPLITS for row in reference[split]) == sorted(expected(ROWS))
    for fmt, name in names.items():
        ds = load_task(name, "train")
        assert ds.column_names == list(TASK_COLUMNS)
        assert set(ds["task"]) == {name}


def _split_column(fmt, tmp):
    # the splits interleaved in the file (test, validation, train, test, ...): each keeps its order
    tagged = [(i / len(GIVEN[split]), -n, {**row, "split": split})
              for n, split in enumerate(SPLITS) for i, row in enumerate(GIVEN[split])]
    rows = [row for *_, row in sorted(tagged, key=lambda t: t[:2])]
    return f"{fmt}:{write(fmt, tmp / f'split-column.{fmt}', rows)}"


def _per_split(fmt, tmp):
    parts = [f"{split}={write(fmt, tmp / f'{split}.{fmt}', GIVEN[split])}" for split in SPLITS]
    return f"{fmt}:" + ",".join(parts)


def _dataset_dict(tmp):
    folder = tmp / "dict"
    parts = {split: datasets.Dataset.from_list(GIVEN[split]) for split in SPLITS}
    datasets.DatasetDict(parts).save_to_disk(str(folder))
    return f"disk:{folder}"


GIVEN_SOURCES = {
    "split column, jsonl": lambda tmp: _split_column("jsonl", tmp),
    "split column, csv": lambda tmp: _split_column("csv", tmp),
    "split column, parquet": lambda tmp: _split_column("parquet", tmp),
    "split column, disk Dataset": lambda tmp: _split_column("disk", tmp),
    "per-split files, jsonl": lambda tmp: _per_split("jsonl", tmp),
    "per-split files, csv": lambda tmp: _per_split("csv", tmp),
    "per-split files, parquet": lambda tmp: _per_split("parquet", tmp),
    "disk DatasetDict": _dataset_dict,
}


@pytest.mark.parametrize("source", list(GIVEN_SOURCES))
def test_splits_the_source_gives_are_kept_as_given(source, tmp_path):
    name = GIVEN_SOURCES[source](tmp_path)
    for split in SPLITS:
        # the fractions do not touch splits the source gives
        assert seen(load_task(name, split, validation_fraction=0.3, test_fraction=0.3)) == expected(GIVEN[split]), split


def test_a_split_the_per_split_files_leave_out_is_carved_from_train(tmp_path):
    name = (f"jsonl:train={write_jsonl(tmp_path / 'train.jsonl', GIVEN['train'])},"
            f"test={write_jsonl(tmp_path / 'test.jsonl', GIVEN['test'])}")
    got = {split: seen(load_task(name, split, validation_fraction=0.25)) for split in SPLITS}
    assert got["test"] == expected(GIVEN["test"])
    assert got["validation"] and got["train"]
    assert sorted(got["train"] + got["validation"]) == sorted(expected(GIVEN["train"]))
    assert not {row[1] for row in got["train"]} & {row[1] for row in got["validation"]}
    # a DatasetDict with train and test only: the same carve
    folder = tmp_path / "dict"
    datasets.DatasetDict({s: datasets.Dataset.from_list(GIVEN[s]) for s in ("train", "test")}).save_to_disk(str(folder))
    assert {split: seen(load_task(f"disk:{folder}", split, validation_fraction=0.25)) for split in SPLITS} == got


# ------------------------------------------------------------------- 2. answers, columns, ids

def test_answer_is_a_string_or_a_list_and_other_columns_are_ignored(tmp_path):
    rows = [{"context": "Ann has a red kite.", "question": "What does Ann have?", "answer": "a red kite",
             "notes": {"source": "me"}, "score": 3},
            {"context": "Ann has a red kite.", "question": "What colour is it?", "answer": ["red", "Red", "crimson"],
             "notes": None, "score": 1.5},
            {"context": "Bob owns a dog.", "question": "Who owns a dog?", "answer": ["Bob"], "score": 0}]
    # strings and lists in one JSON Lines file; two contexts: too few to carve, all train
    got = load_task(f"jsonl:{write_jsonl(tmp_path / 'mixed.jsonl', rows)}", "train").to_list()
    assert [(r["answer"], r["answers"]) for r in got] == [
        ("a red kite", ["a red kite"]), ("red", ["red", "Red", "crimson"]), ("Bob", ["Bob"])]
    assert all(list(r) == list(TASK_COLUMNS) for r in got)
    # every answer a list, through parquet and a save_to_disk folder
    listed = [{**row, "answer": row["answer"] if isinstance(row["answer"], list) else [row["answer"]]}
              for row in rows]
    listed = [{k: v for k, v in row.items() if k != "notes"} for row in listed]
    for name in (f"parquet:{write('parquet', tmp_path / 'lists.parquet', listed)}",
                 f"disk:{write('disk', tmp_path / 'lists', listed)}"):
        got = load_task(name, "train").to_list()
        assert [r["answers"] for r in got] == [["a red kite"], ["red", "Red", "crimson"], ["Bob"]], name
        assert [r["answer"] for r in got] == ["a red kite", "red", "Bob"], name


def test_columns_map_another_naming(tmp_path):
    standard = load_task(f"jsonl:{write_jsonl(tmp_path / 'standard.jsonl', ROWS)}", "test")
    renamed = [{"uid": r["id"], "passage": r["context"], "question": r["question"], "gold": r["answer"],
                "context": "a column of the same name that the mapping leaves unread"} for r in ROWS]
    for fmt in ("jsonl", "csv", "parquet"):
        name = f"{fmt}:{write(fmt, tmp_path / f'renamed.{fmt}', renamed)}"
        got = load_task(name, "test", columns={"context": "passage", "answer": "gold", "id": "uid"})
        assert seen(got) == seen(standard), fmt
        without_id = load_task(name, "test", columns={"context": "passage", "answer": "gold"})
        assert [r[1:] for r in seen(without_id)] == [r[1:] for r in seen(standard)], fmt


def test_a_missing_id_gets_a_stable_generated_id(tmp_path):
    name = f"jsonl:{write_jsonl(tmp_path / 'noid.jsonl', make_rows(12, ids=False))}"
    first, again = all_splits(name), all_splits(name)
    assert first == again
    ids = [r["id"] for split in SPLITS for r in first[split]]
    assert len(set(ids)) == len(ids) == 24 and all(isinstance(i, str) and i for i in ids)
    # a row keeps its id whichever split another seed carves it into
    def by_question(splits):
        return {r["question"]: r["id"] for split in SPLITS for r in splits[split]}
    assert by_question(all_splits(name, seed=7)) == by_question(first)
    # given ids (strings or ints) are kept, as strings
    given = write_jsonl(tmp_path / "ints.jsonl", [{**r, "id": 100 + i} for i, r in enumerate(make_rows(2, ids=False))])
    assert load_task(f"jsonl:{given}", "train")["id"] == ["100", "101", "102", "103"]


# --------------------------------------------------------------------------------- 3. carving

def test_carved_splits_hold_whole_contexts_and_are_deterministic(tmp_path):
    rows = make_rows(30, per_context=3)
    name = f"jsonl:{write_jsonl(tmp_path / 'rows.jsonl', rows)}"
    splits = all_splits(name, validation_fraction=0.2, test_fraction=0.2)
    assert all(splits[s] for s in SPLITS)
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert not contexts(splits[a]) & contexts(splits[b]), (a, b)
    assert sorted(r["id"] for s in SPLITS for r in splits[s]) == sorted(r["id"] for r in rows)
    assert all_splits(name, validation_fraction=0.2, test_fraction=0.2) == splits


def test_another_seed_carves_other_contexts(tmp_path):
    name = f"jsonl:{write_jsonl(tmp_path / 'rows.jsonl', make_rows(40))}"
    carves = {seed: {s: contexts(load_task(name, s, seed=seed)) for s in ("validation", "test")} for seed in (0, 1)}
    assert carves[0]["test"] != carves[1]["test"]
    assert carves[0]["validation"] != carves[1]["validation"]
    assert len(carves[0]["test"]) == len(carves[1]["test"]) == 4


def test_carved_fractions_are_about_right(tmp_path):
    n_contexts = 500
    name = f"jsonl:{write_jsonl(tmp_path / 'many.jsonl', make_rows(n_contexts))}"
    fractions = {"validation": 0.2, "test": 0.1}
    splits = all_splits(name, validation_fraction=fractions["validation"], test_fraction=fractions["test"])
    for split, fraction in fractions.items():
        assert abs(len(contexts(splits[split])) - fraction * n_contexts) <= 1, split
        assert len(splits[split]) == 2 * len(contexts(splits[split]))
    assert len(splits["train"]) + len(splits["validation"]) + len(splits["test"]) == 2 * n_contexts


# ------------------------------------------------------------------------------- 4. cache key

def test_the_cache_key_hashes_content_not_paths(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_jsonl(tmp_path / "a" / "rows.jsonl", ROWS)
    b = tmp_path / "b" / "other-name.jsonl"
    shutil.copyfile(a, b)
    key = task_config_key(f"jsonl:{a}", "train")
    assert task_config_key(f"jsonl:{b}", "train") == key
    text = json.dumps(key)
    assert json.loads(text) == key and str(tmp_path) not in text
    # changed content: another file, and the same file rewritten in place
    changed = write_jsonl(tmp_path / "b" / "changed.jsonl", [*ROWS[:-1], {**ROWS[-1], "answer": "something else"}])
    assert task_config_key(f"jsonl:{changed}", "train") != key
    write_jsonl(a, ROWS + make_rows(13)[-2:])
    assert task_config_key(f"jsonl:{a}", "train") != key
    # the settings that change the rows change the key
    assert task_config_key(f"jsonl:{b}", "train", seed=1) != key
    assert task_config_key(f"jsonl:{b}", "train", test_fraction=0.2) != key
    assert task_config_key(f"jsonl:{b}", "train", columns={"context": "passage"}) != key


def test_the_cache_key_of_a_folder_and_of_per_split_files(tmp_path):
    folder = write("disk", tmp_path / "one" / "data", ROWS)
    copy = shutil.copytree(folder, tmp_path / "two" / "elsewhere")
    assert task_config_key(f"disk:{folder}", "test") == task_config_key(f"disk:{copy}", "test")
    json.dumps(task_config_key(f"disk:{folder}", "test"))
    names = []
    for sub in ("x", "y"):
        (tmp_path / sub).mkdir()
        names.append(f"jsonl:train={write_jsonl(tmp_path / sub / 'train.jsonl', GIVEN['train'])},"
                     f"test={write_jsonl(tmp_path / sub / 'test.jsonl', GIVEN['test'])}")
    keys = [task_config_key(name, "validation") for name in names]
    assert keys[0] == keys[1] and str(tmp_path) not in json.dumps(keys[0])
    write_jsonl(tmp_path / "y" / "test.jsonl", GIVEN["test"][:-1])
    assert task_config_key(names[1], "validation") != keys[0]


# ----------------------------------------------------------------------------- 5. bad inputs

GOOD = [{"context": "Ann is in the kitchen.", "question": "Where is Ann?", "answer": "kitchen"},
        {"context": "Ann is in the kitchen.", "question": "Who is in the kitchen?", "answer": "Ann"}]
BAD: dict = {}


def bad(name):
    """A case of BAD: a function of tmp_path returning (task name, split, kwargs, the file the
    message starts with, the line it names or None, words it holds)."""
    def add(prepare):
        BAD[name] = prepare
        return prepare
    return add


def _bad_jsonl(tmp, last: dict, line_breaks: str = "") -> Path:
    path = tmp / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD) + line_breaks + json.dumps(last) + "\n")
    return path


for _fmt, _path in (("jsonl", "none.jsonl"), ("csv", "none.csv"), ("parquet", "none.parquet"), ("disk", "none")):
    @bad(f"missing file, {_fmt}")
    def _(tmp, fmt=_fmt, path=_path):
        return f"{fmt}:{tmp / path}", "train", {}, tmp / path, None, ["no such"]


@bad("jsonl: missing column")
def _(tmp):
    path = write_jsonl(tmp / "cols.jsonl", [{"context": "c", "query": "q", "answer": "a"}])
    return f"jsonl:{path}", "train", {}, path, None, ["missing column(s) question", "context, query, answer"]


@bad("csv: missing column")
def _(tmp):
    path = tmp / "cols.csv"
    path.write_text("passage,question,gold\np,q,a\n")
    return f"csv:{path}", "train", {}, path, None, ["missing column(s) context, answer", "passage, question, gold"]


@bad("parquet: a mapped column missing")
def _(tmp):
    path = write("parquet", tmp / "cols.parquet", GOOD)
    return (f"parquet:{path}", "train", {"columns": {"context": "passage"}}, path, None,
            ["context (as 'passage')", "context, question, answer"])


for _field in ("context", "question", "answer"):
    @bad(f"jsonl: empty {_field}")
    def _(tmp, field=_field):
        path = _bad_jsonl(tmp, {**GOOD[0], field: " "}, line_breaks="\n")  # a blank line 3 still counts
        return f"jsonl:{path}", "train", {}, path, 4, [f"{field} is empty"]


@bad("csv: empty question")
def _(tmp):
    path = tmp / "empty.csv"
    path.write_text('context,question,answer\n"two\nlines",q,a\nc,,a\n')  # a quoted field over lines 2-3
    return f"csv:{path}", "train", {}, path, 4, ["question"]


@bad("jsonl: a number as question")
def _(tmp):
    path = _bad_jsonl(tmp, {**GOOD[0], "question": 42})
    return f"jsonl:{path}", "train", {}, path, 3, ["question must be a string", "int"]


@bad("jsonl: null context")
def _(tmp):
    path = _bad_jsonl(tmp, {**GOOD[0], "context": None})
    return f"jsonl:{path}", "train", {}, path, 3, ["context must be a string", "null"]


@bad("parquet: numbers as questions")
def _(tmp):
    path = write("parquet", tmp / "numbers.parquet", [{**row, "question": i} for i, row in enumerate(GOOD)])
    return f"parquet:{path}", "train", {}, path, None, ["question must be a string", "int"]


@bad("jsonl: an empty answer list")
def _(tmp):
    path = _bad_jsonl(tmp, {**GOOD[0], "answer": []})
    return f"jsonl:{path}", "train", {}, path, 3, ["answer is an empty list"]


@bad("jsonl: a number in the answer list")
def _(tmp):
    path = _bad_jsonl(tmp, {**GOOD[0], "answer": ["kitchen", 7]})
    return f"jsonl:{path}", "train", {}, path, 3, ["answer[1] must be a string"]


@bad("jsonl: invalid JSON")
def _(tmp):
    path = tmp / "broken.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n\n" + json.dumps(GOOD[1]) + "\n{\"context\": \"c\", question\n")
    return f"jsonl:{path}", "train", {}, path, 4, ["not a JSON object"]


@bad("jsonl: a line that is not an object")
def _(tmp):
    path = tmp / "array.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n[1, 2]\n")
    return f"jsonl:{path}", "train", {}, path, 2, ["not a JSON object", "list"]


@bad("split column: no test rows and no test fraction")
def _(tmp):
    path = write_jsonl(tmp / "all-train.jsonl", [{**row, "split": "train"} for row in make_rows(6)])
    return f"jsonl:{path}", "test", {"test_fraction": 0.0}, path, None, ["test split has no rows"]


@bad("too few contexts to carve a validation split")
def _(tmp):
    path = write_jsonl(tmp / "two.jsonl", make_rows(2))
    return f"jsonl:{path}", "validation", {}, path, None, ["validation split has no rows"]


@bad("split column: an unknown split")
def _(tmp):
    path = write_jsonl(tmp / "dev.jsonl", [{**GOOD[0], "split": "train"}, {**GOOD[1], "split": "dev"}])
    return f"jsonl:{path}", "train", {}, path, 2, ["split must be one of", "'dev'"]


@bad("DatasetDict: an unknown split name")
def _(tmp):
    folder = tmp / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "dev": datasets.Dataset.from_list(ROWS)}
                         ).save_to_disk(str(folder))
    return f"disk:{folder}", "train", {}, folder, None, ["DatasetDict", "dev"]


def check_one_line(message: str, path: Path, line: int | None, words) -> None:
    assert "\n" not in message and message.strip() == message, message
    assert message.startswith(str(path)), message
    if line is None:
        assert not re.search(r", line \d+", message), message
    else:
        assert message.startswith(f"{path}, line {line}:"), message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_naming_the_file(case, tmp_path):
    name, split, kwargs, path, line, words = BAD[case](tmp_path)
    with pytest.raises(TaskFormatError) as caught:
        load_task(name, split, **kwargs)
    assert isinstance(caught.value, ValueError)
    check_one_line(str(caught.value), path, line, words)


def test_a_context_longer_than_max_tokens(tiny_lm, tmp_path):
    long = {"context": "The kitchen is north of the garden. " * 20, "question": "Where?", "answer": "north"}
    path = write_jsonl(tmp_path / "long.jsonl", [*GOOD, long])
    n = len(tiny_lm.tokenizer.encode(long["context"], add_special_tokens=False))
    assert n > 32
    with pytest.raises(TaskFormatError) as caught:
        load_task(f"jsonl:{path}", "train", tokenizer=tiny_lm.tokenizer, max_tokens=32)
    check_one_line(str(caught.value), path, 3, [f"{n:,} tokens", "32"])
    # without a limit (the sender cuts long contexts) the same rows load
    assert len(load_task(f"jsonl:{path}", "train", tokenizer=tiny_lm.tokenizer, max_tokens=None)) == 3
    assert len(load_task(f"jsonl:{path}", "train", tokenizer=tiny_lm.tokenizer, max_tokens=n)) == 3


# ---------------------------------------------------------------------- 6. through ilcp-train

def cli_error(main, argv, capsys) -> tuple[int, str]:
    """Run a command line in-process: its exit code and its one error line (as test_bad_inputs)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith(("usage:", " ", "[ilcp]"))]
    assert len(lines) == 1 and "error: " in lines[0], err
    return code, lines[0]


TRAIN_CASES = {
    "missing jsonl file": lambda tmp: (["data.task=jsonl:" + str(tmp / "none.jsonl")], tmp / "none.jsonl",
                                       ["no such file"]),
    "missing csv file": lambda tmp: (["data.task=csv:" + str(tmp / "none.csv")], tmp / "none.csv", ["no such file"]),
    "missing column": lambda tmp: (
        ["data.task=jsonl:" + str(write_jsonl(tmp / "cols.jsonl", [{"context": "c", "query": "q", "answer": "a"}]))],
        tmp / "cols.jsonl", ["missing column(s) question", "context, query, answer"]),
    "a mapped column missing": lambda tmp: (
        ["data.task=jsonl:" + str(write_jsonl(tmp / "rows.jsonl", ROWS)), "data.columns.context=passage"],
        tmp / "rows.jsonl", ["context (as 'passage')"]),
}


def _broken_json(tmp):
    path = tmp / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    return ["data.task=jsonl:" + str(path)], path, [", line 2:", "not a JSON object"]


TRAIN_CASES["invalid JSON"] = _broken_json


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_command_refuses_a_bad_task_file(case, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    overrides, path, words = TRAIN_CASES[case](data)
    runs = tmp_path / "runs"
    before = listing(tmp_path)
    code, line = cli_error(cli.train_main, ["--config", str(TINY), *overrides, f"out_dir={runs}", "run_name=filetask",
                                            f"lm.cache_dir={tmp_path / 'cache'}"], capsys)
    assert code == 2
    assert f"error: {path}" in line or f"error: data.task: {path}" in line, line
    for word in words:
        assert word in line, (word, line)
    assert not (runs / "filetask").exists() and listing(tmp_path) == before


# ---------------------------------------------------------------------------------- 7. babi:all

def test_babi_all_is_balanced_over_the_shipped_tasks():
    rows = load_task("babi:all", "train", variant="en", limit=150)
    assert Counter(rows["task"]) == {f"babi-qa{n}": 10 for n in SHIPPED_BABI}
    assert Counter(load_task("babi:1+2", "train", limit=7)["task"]) == {"babi-qa1": 4, "babi-qa2": 3}
    assert [t.name for t in resolve_task("babi:all").parts()] == [f"babi:{n}" for n in SHIPPED_BABI]


def test_babi_all_from_a_variant_that_lacks_tasks_is_refused():
    with pytest.raises((FileNotFoundError, ValueError), match="lacks") as caught:
        load_task("babi:all", "train", variant="en-10k", limit=10)
    assert "en-10k" in str(caught.value)


# ---------------------------------------------------------------------------- 8. SQuAD scoring

# (prediction, accepted answers, EM, F1) by the official SQuAD v1.1 evaluate script: lower case,
# delete the characters of string.punctuation, drop the words a/an/the, squeeze whitespace; EM:
# the normalised strings are equal; F1 = 2PR/(P+R) over the multiset of common tokens; the best
# over the accepted answers, each metric separately.
SQUAD_CASES = {
    # "the eiffel tower" -> "eiffel tower" == "eiffel tower": EM 1, F1 1
    "article and case": ("The Eiffel Tower", ["eiffel tower"], 1.0, 1.0),
    # "Paris!!" -> "paris"; "PARIS." -> "paris": EM 1, F1 1
    "punctuation and case": ("Paris!!", ["PARIS."], 1.0, 1.0),
    # punctuation is deleted, not replaced by a space: "new-york" -> "newyork" == "newyork"
    "punctuation inside a word": ("New-York", ["NewYork"], 1.0, 1.0),
    # "theatre" keeps its "the" (articles only as words), "an" goes: "theatre anchor" == "theatre anchor"
    "articles as words only": ("Theatre an Anchor", ["theatre anchor"], 1.0, 1.0),
    # pred "in the city of Paris" -> [in, city, of, paris] (4); gold "Paris, France" -> [paris, france] (2);
    # common {paris} = 1: P = 1/4, R = 1/2, F1 = 2 * 1/8 / (3/4) = 1/3; EM 0
    "partial overlap": ("in the city of Paris", ["Paris, France"], 0.0, 1 / 3),
    # pred [cat, cat, cat] ("the" dropped) vs gold [cat, sat]: common is a multiset, min(3, 1) = 1 cat:
    # P = 1/3, R = 1/2, F1 = 2 * 1/6 / (5/6) = 2/5
    "repeated tokens": ("the cat cat cat", ["cat sat"], 0.0, 0.4),
    # pred [denver, broncos]; vs "Broncos" [broncos]: P = 1/2, R = 1, F1 = 1 / 1.5 = 2/3;
    # vs "the Denver Broncos team" [denver, broncos, team]: P = 1, R = 2/3, F1 = (4/3) / (5/3) = 4/5;
    # vs "Carolina": 0. Max F1 = 0.8; no EM
    "several answers, best F1": ("Denver Broncos", ["Broncos", "the Denver Broncos team", "Carolina"], 0.0, 0.8),
    # EM from the second answer ("the broncos." -> "broncos"); F1 vs "Denver": 0, vs the second: 1
    "several answers, EM from the second": ("Broncos", ["Denver", "the broncos."], 1.0, 1.0),
    # [berlin] vs [paris]: no common token: EM 0, F1 0
    "no overlap": ("Berlin", ["Paris"], 0.0, 0.0),
}


@pytest.mark.parametrize("case", list(SQUAD_CASES))
def test_squad_scores_equal_the_official_script(case):
    prediction, answers, em, f1 = SQUAD_CASES[case]
    got_em, got_f1 = squad_scores(prediction, answers)
    assert got_em == pytest.approx(em, abs=1e-6)
    assert got_f1 == pytest.approx(f1, abs=1e-6)


def test_accuracy_summary_of_open_text_is_the_mean_squad_score():
    predictions = [case[0] for case in SQUAD_CASES.values()]
    answers = [case[1] for case in SQUAD_CASES.values()]
    n = len(SQUAD_CASES)
    mean_em = sum(case[2] for case in SQUAD_CASES.values()) / n  # 5 / 9
    mean_f1 = sum(case[3] for case in SQUAD_CASES.values()) / n  # (5 + 1/3 + 2/5 + 4/5) / 9
    summary = accuracy_summary(predictions, answers, open_text=True)
    assert summary["n"] == n and summary["scoring"] == "squad"
    assert summary["exact_match"] == pytest.approx(mean_em, abs=1e-6)
    assert summary["f1"] == pytest.approx(mean_f1, abs=1e-6)
    low, high = summary["f1_ci"]
    assert 0.0 <= low <= mean_f1 <= high <= 1.0 and low < high
    # the closed exact match (bAbI's: punctuation becomes a space) would not count "New-York"
    assert not exact_match("New-York", ["NewYork"])
    assert summary["exact_match"] > accuracy_summary(predictions, answers)["exact_match"]


# ------------------------------------------------------------------------------ 9. shipped squad

@pytest.fixture(scope="module")
def squad_splits():
    return {split: load_task("squad", split).to_list() for split in SPLITS}


def test_the_shipped_squad_task(squad_splits):
    assert {split: len(rows) for split, rows in squad_splits.items()} == {"train": 3004, "validation": 308, "test": 506}
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert not contexts(squad_splits[a]) & contexts(squad_splits[b]), (a, b)
    articles = {split: {re.fullmatch(r"squad-(.+)-p\d+-q\d+", r["id"]).group(1) for r in rows}
                for split, rows in squad_splits.items()}
    assert not articles["train"] & articles["validation"] and not articles["train"] & articles["test"]
    assert not articles["validation"] & articles["test"]
    for rows in squad_splits.values():
        assert all(r["answers"] and all(a.strip() for a in r["answers"]) and r["answer"] == r["answers"][0]
                   for r in rows)
        assert {r["task"] for r in rows} == {"squad"}
    assert resolve_task("squad").open_answers is True


def test_the_sweep_reads_file_task_names_through_the_registry(tmp_path):
    """A sweep's eval.tasks takes a file task (a per-split list keeps its commas) and refuses a
    missing file in one line."""
    from ilcp_experiments.sweep.schema import SweepError, eval_settings

    notes = tmp_path / "notes.jsonl"
    notes.write_text(json.dumps({"context": "c", "question": "q", "answer": "a"}) + "\n")
    where = tmp_path / "sweep.yaml"
    settings = eval_settings({"tasks": f"babi:2,jsonl:train={notes},test={notes}"}, where, None)
    assert settings.tasks == ("babi:2", f"jsonl:train={notes},test={notes}")
    with pytest.raises(SweepError, match="missing.jsonl: no such file"):
        eval_settings({"tasks": [f"jsonl:{tmp_path / 'missing.jsonl'}"]}, where, None)


def test_a_run_trains_and_evaluates_on_a_file_of_its_own(tmp_path, tiny_lm):
    """train on a user's JSON Lines file with another column naming, then evaluate its carved test
    split and a second file: the export records the mapping and the split settings, eval reads both
    files with them and scores them as SQuAD does (F1 with an interval)."""
    from ilcp.config import load_config
    from ilcp.evaluation.run import evaluate
    from ilcp.training import train

    rows = [{"passage": f"Item {i} is kept in box {i % 7}.", "question": f"Where is item {i}?",
             "gold": [f"box {i % 7}", f"in box {i % 7}"], "note": "ignored"} for i in range(60)]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    other_train = tmp_path / "other-train.jsonl"  # its own train file: splits given apart share no context
    other_train.write_text("".join(json.dumps(r) + "\n" for r in rows[5:10]))
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"out_dir={tmp_path / 'runs'}", f"data.task=jsonl:{mine}", "data.columns.context=passage",
        "data.columns.answer=gold", "data.test_fraction=0.2", "run_name=mine"])
    result = train(cfg, lm=tiny_lm)
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["task"] == f"jsonl:{mine}"
    assert config["task_settings"]["columns"] == {"context": "passage", "answer": "gold"}
    assert config["task_settings"]["test_fraction"] == 0.2
    results = evaluate(result.run_dir, lm=tiny_lm, tasks=[f"jsonl:test={other},train={other_train}"], limit=None,
                       latency_n=0, lengths=[], methods=["no_context", "cold_read"])
    test = load_task(f"jsonl:{mine}", "test", columns={"context": "passage", "answer": "gold"}, test_fraction=0.2)
    own = results["tasks"][f"jsonl:{mine}"]
    assert own["seen_in_training"] and own["n"] == len(test) == 12  # 12 of 60 contexts carved for test
    for method in own["methods"].values():
        assert method["scoring"] == "squad" and len(method["f1_ci"]) == 2
    held_out = results["tasks"][f"jsonl:train={other_train},test={other}"]
    assert not held_out["seen_in_training"] and held_out["n"] == 5

"""File task inputs that were silently wrong or slow to fail: questions and answers beyond the LM's
positions (through `load_files`, ``train`` and eval's test rows, refused before they are
tokenised), splits given apart that share a file or contexts, ids and rows given twice, a file
rewritten with its size and modification time restored, and files that are empty, row-less, not
UTF-8, not regular, carry a byte-order mark or hold a comma in their path.

Every file is written under the test's tmp_path; `datasets`' Arrow cache and the package's cache
(``$ILCP_CACHE``) go to temporary folders, so the user's ~/.cache is left alone.
"""

import csv
import io
import json
import os
import threading
import time
from pathlib import Path

import datasets
import pytest

from ilcp.cli import build_eval_parser
from ilcp.config import load_config
from ilcp.eval_config import EvalConfig
from ilcp.names import split_task_names
from ilcp.tasks import SPLITS, TaskFormatError, load_task, resolve_task
from ilcp.tasks.files import file_config_key, load_files
from ilcp.tasks.registry import EvalTaskContext

from test_task_files import check_one_line, make_rows, write_jsonl

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
HUGE_QUESTION = "Where? " * 750000  # 5,250,000 characters
HUGE_ANSWER = "Kitchen " * 650000  # 5,200,000 characters
LIMIT = 4096  # the tiny LM's positions


@pytest.fixture(autouse=True, scope="module")
def _caches(tmp_path_factory):
    """`datasets`' cache and the package's (where file tasks are read from) in temporary folders."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))
        mp.setenv("ILCP_CACHE", str(tmp_path_factory.mktemp("ilcp-cache")))
        yield


@pytest.fixture
def guarded_tokenizer(tiny_lm, monkeypatch):
    """The tiny LM's tokenizer, made to fail if it is ever given a text of over a million characters."""
    cls = type(tiny_lm.tokenizer)

    def guard(original):
        def call(self, text=None, *args, **kwargs):
            texts = text if isinstance(text, (list, tuple)) else [text]
            if any(isinstance(t, str) and len(t) > 1_000_000 for t in texts):
                raise AssertionError(f"the tokenizer was given a text of {max(map(len, texts)):,} characters")
            return original(self, text, *args, **kwargs)
        return call

    monkeypatch.setattr(cls, "__call__", guard(cls.__call__))
    monkeypatch.setattr(cls, "encode", guard(cls.encode))
    return tiny_lm.tokenizer


def with_split(rows: list[dict], split: str) -> list[dict]:
    return [{**row, "split": split} for row in rows]


def given_splits(rows: list[dict]) -> list[dict]:
    """``rows`` with a split column: two thirds train, a sixth validation, a sixth test (by context)."""
    n = len(rows) // 6
    return with_split(rows[:4 * n], "train") + with_split(rows[4 * n:5 * n], "validation") + \
        with_split(rows[5 * n:], "test")


def one_huge_row(tmp: Path, field: str, split: str = "train") -> tuple[Path, int]:
    """24 good rows (train, validation and test) and, on line 25, one whose ``field`` is 5 MB (in ``split``)."""
    huge = {"id": "huge", "context": "Story 99: the box is in the kitchen.", "question": "Where is the box?",
            "answer": "kitchen", "split": split}
    huge[field] = HUGE_QUESTION if field == "question" else HUGE_ANSWER
    path = write_jsonl(tmp / f"huge-{field}.jsonl", given_splits(make_rows(12)) + [huge])
    assert path.stat().st_size > 5_000_000
    return path, 25


# ------------------------------------------------------------------ item 3: questions and answers

@pytest.mark.parametrize("field", ["question", "answer"])
def test_a_5mb_question_or_answer_is_refused_with_file_and_line_before_tokenising(field, tmp_path,
                                                                                   guarded_tokenizer):
    path, line = one_huge_row(tmp_path, field)
    start = time.monotonic()
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{path}", "train", tokenizer=guarded_tokenizer, text_limit=LIMIT)
    assert time.monotonic() - start < 10
    check_one_line(str(caught.value), path, line, [f"the {field} has", "characters", f"{LIMIT} tokens", "shorten it"])
    # without a tokenizer the characters alone refuse it
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{path}", "train", text_limit=LIMIT)
    check_one_line(str(caught.value), path, line, [f"the {field} has"])


def test_a_question_over_the_limit_in_tokens_is_refused_by_its_tokens(tmp_path, tiny_lm):
    question = "Where is the box " * 40 + "?"
    n = len(tiny_lm.tokenizer.encode(question, add_special_tokens=False))
    path = write_jsonl(tmp_path / "long.jsonl", given_splits(make_rows(3))
                       + [{"context": "Story x.", "question": question, "answer": "here", "split": "train"}])
    assert len(question) < 64 * 32 < n * 32  # within 64 tokens by its characters, not by its tokens
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{path}", "train", tokenizer=tiny_lm.tokenizer, text_limit=64)
    check_one_line(str(caught.value), path, 7, [f"the question is {n:,} tokens", "limit of 64"])
    assert len(load_files(f"jsonl:{path}", "train", tokenizer=tiny_lm.tokenizer, text_limit=n)) == 5


@pytest.mark.parametrize("field", ["question", "answer"])
def test_train_refuses_a_5mb_question_or_answer_naming_file_and_line(field, tmp_path, tiny_lm, guarded_tokenizer):
    from ilcp.training import train

    path, line = one_huge_row(tmp_path, field)
    cfg = load_config(TINY, [f"out_dir={tmp_path / 'runs'}", f"lm.cache_dir={tmp_path / 'cache'}",
                             f"data.task=jsonl:{path}", "run_name=huge"])
    start = time.monotonic()
    with pytest.raises(TaskFormatError) as caught:
        train(cfg, lm=tiny_lm)
    assert time.monotonic() - start < 10
    check_one_line(str(caught.value), path, line, [f"the {field} has", f"{LIMIT} tokens"])


@pytest.mark.parametrize("field", ["question", "answer"])
def test_eval_test_rows_refuse_a_5mb_question_or_answer(field, tmp_path, guarded_tokenizer):
    path, line = one_huge_row(tmp_path, field, split="test")
    task = resolve_task(f"jsonl:{path}")
    start = time.monotonic()
    with pytest.raises(TaskFormatError) as caught:
        task.eval_rows(None, EvalTaskContext(tokenizer=guarded_tokenizer, text_limit=LIMIT))
    assert time.monotonic() - start < 10
    check_one_line(str(caught.value), path, line, [f"the {field} has", f"{LIMIT} tokens"])


# ----------------------------------------------------------------- item 7: splits apart, duplicates

OVERLAP_WORDS = ["data.allow_split_overlap=true"]


def test_the_same_file_as_train_and_test_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", make_rows(12))
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:train={path},test={path}", "test")
    check_one_line(str(caught.value), path, None, ["the test file holds the same rows as the train file",
                                                   *OVERLAP_WORDS])
    # a copy under another name is the same rows
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:train={path},test={copy}", "train")
    check_one_line(str(caught.value), copy, None, ["the same rows as the train file"])


def test_a_test_file_whose_contexts_are_in_train_is_refused_naming_the_line(tmp_path):
    rows = make_rows(12)
    train = write_jsonl(tmp_path / "train.jsonl", rows[:16])
    test = write_jsonl(tmp_path / "test.jsonl", rows[16:20] + [{**rows[3], "id": "t-3"}] + rows[20:])
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:train={train},test={test}", "test")
    check_one_line(str(caught.value), test, 5, ["this test row's context is also in train", "1 test row(s)",
                                               *OVERLAP_WORDS])
    # a split column that puts one context in train and validation
    column = write_jsonl(tmp_path / "column.jsonl", with_split(rows[:16], "train") + with_split(rows[16:18], "test")
                         + [{**rows[0], "id": "v-0", "split": "validation"}])
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{column}", "train")
    check_one_line(str(caught.value), column, 19, ["this validation row's context is also in train"])


def test_an_allowed_overlap_loads_and_eval_says_so(tmp_path):
    rows = make_rows(12)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    name = f"jsonl:train={path},test={path}"
    test = load_files(name, "test", allow_overlap=True).to_list()
    assert [r["id"] for r in test] == [r["id"] for r in rows]  # the whole file, ids reused across splits
    train = write_jsonl(tmp_path / "train.jsonl", rows[:16])
    shared = write_jsonl(tmp_path / "shared.jsonl", rows[14:20])
    assert len(load_files(f"jsonl:train={train},test={shared}", "test", allow_overlap=True)) == 6

    cfg = load_config(TINY, [f"data.task={name}", "data.allow_split_overlap=true"])
    task = resolve_task(cfg.data.task)
    settings = task.task_settings(cfg.data)
    assert settings["allow_split_overlap"] is True
    kwargs = task.training_kwargs(cfg.data, 8)
    assert kwargs["allow_overlap"] is True and len(task.load("train", **kwargs)) == 8
    built = task.eval_rows(None, EvalTaskContext(task_settings=settings))
    assert len(built.rows) == 24
    assert "data.allow_split_overlap=true" in built.source and "also be in train" in built.source
    # a run without the setting records nothing and eval refuses the rows
    plain = load_config(TINY, [f"data.task={name}"])
    assert "allow_split_overlap" not in task.task_settings(plain.data)
    with pytest.raises(TaskFormatError, match="same rows as the train file"):
        task.eval_rows(None, EvalTaskContext(task_settings=task.task_settings(plain.data)))


def test_train_refuses_the_same_file_as_train_and_test(tmp_path, tiny_lm):
    from ilcp.training import train

    path = write_jsonl(tmp_path / "rows.jsonl", make_rows(12))
    cfg = load_config(TINY, [f"out_dir={tmp_path / 'runs'}", f"lm.cache_dir={tmp_path / 'cache'}",
                             f"data.task=jsonl:train={path},test={path}", "run_name=same"])
    with pytest.raises(TaskFormatError) as caught:
        train(cfg, lm=tiny_lm)
    check_one_line(str(caught.value), path, None, ["the same rows as the train file", *OVERLAP_WORDS])


def test_an_id_given_twice_is_refused_naming_both_lines(tmp_path):
    rows = make_rows(12)
    path = write_jsonl(tmp_path / "ids.jsonl", rows + [{**rows[3], "question": "What else is in the box?"}])
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{path}", "train")
    check_one_line(str(caught.value), path, 25, [f"id {rows[3]['id']!r} is also the id of {path}, line 4",
                                               "ids must be unique"])
    # every id the same
    same = write_jsonl(tmp_path / "same-id.jsonl", [{**row, "id": "x"} for row in rows])
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{same}", "test")
    check_one_line(str(caught.value), same, 2, [f"id 'x' is also the id of {same}, line 1"])
    # ids numbered from 0 in each per-split file are fine: answers are joined within a split
    train = write_jsonl(tmp_path / "train.jsonl", [{**row, "id": i} for i, row in enumerate(rows[:16])])
    test = write_jsonl(tmp_path / "test.jsonl", [{**row, "id": i} for i, row in enumerate(rows[16:])])
    assert [r["id"] for r in load_files(f"jsonl:train={train},test={test}", "test")] == [str(i) for i in range(8)]


@pytest.mark.parametrize("ids", [True, False])
def test_the_whole_file_listed_twice_is_refused(ids, tmp_path):
    rows = make_rows(12, ids=ids)
    path = write_jsonl(tmp_path / "twice.jsonl", rows + rows)
    with pytest.raises(TaskFormatError) as caught:
        load_files(f"jsonl:{path}", "train")
    words = [f"is also the id of {path}, line 1"] if ids else [f"the same row (context, question and answer) as "
                                                                f"{path}, line 1", "remove the copy"]
    check_one_line(str(caught.value), path, 25, words)


# ---------------------------------------------------------------------- item 8: rewritten files

def test_a_same_size_rewrite_with_its_mtime_restored_is_read_anew(tmp_path):
    rows = make_rows(12)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    before = path.stat()
    name = f"jsonl:{path}"
    old_key = file_config_key(name, "train")
    old = {split: load_files(name, split).to_list() for split in SPLITS}
    new_rows = [{**row, "answer": row["answer"].replace("item", "ITEM")} for row in rows]
    write_jsonl(path, new_rows)  # `cp -p` / `rsync -t`: same size, old modification time
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert file_config_key(name, "train") != old_key
    new = {split: load_files(name, split).to_list() for split in SPLITS}
    assert [r["id"] for s in SPLITS for r in new[s]] == [r["id"] for s in SPLITS for r in old[s]]
    assert all(r["answer"].startswith("ITEM") for s in SPLITS for r in new[s])
    assert all(r["answer"].startswith("item") for s in SPLITS for r in old[s])


# ------------------------------------------------------------------ item 9: files that do not read

@pytest.mark.parametrize("fmt, content, line, words", [
    ("jsonl", b"", None, ["empty file: no rows"]),
    ("jsonl", b"\n  \n", None, ["no rows"]),
    ("csv", b"", None, ["empty file: no rows"]),
    ("csv", b"context,question,answer\n", None, ["no rows (only a header line)"]),
    ("csv", b"context,question,answer\n\n", None, ["no rows (only a header line)"]),
])
def test_an_empty_or_row_less_file_is_one_line(fmt, content, line, words, tmp_path):
    path = tmp_path / f"empty.{fmt}"
    path.write_bytes(content)
    for split in ("train", "test"):
        with pytest.raises(TaskFormatError) as caught:
            load_task(f"{fmt}:{path}", split)
        check_one_line(str(caught.value), path, line, words)
        assert "StopIteration" not in str(caught.value) and "corresponds to no data" not in str(caught.value)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_file_that_is_not_utf8_names_the_file_and_the_byte(fmt, tmp_path):
    path = tmp_path / f"latin1.{fmt}"
    good = json.dumps(make_rows(1)[0]).encode() + b"\n" if fmt == "jsonl" else b"context,question,answer\nc,q,a\n"
    bad = '{"context": "Caf\u00e9", "question": "q", "answer": "a"}\n' if fmt == "jsonl" else "Caf\u00e9,q,a\n"
    path.write_bytes(good + bad.encode("latin-1"))
    offset = len(good) + bad.index("\u00e9")
    with pytest.raises(TaskFormatError) as caught:
        load_task(f"{fmt}:{path}", "train")
    check_one_line(str(caught.value), path, None, ["not UTF-8 text", f"byte 0xe9 at offset {offset}", "save it as UTF-8"])


def test_a_fifo_or_a_link_to_a_device_is_refused_and_never_read(tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    cases = {fifo: ["a FIFO", "a file task reads a regular file"],
             zero: ["a device (through a link)", "a file task reads a regular file"]}
    for path, words in cases.items():
        for call in (lambda: load_task(f"jsonl:{path}", "train"), lambda: file_config_key(f"jsonl:{path}", "train"),
                     lambda: resolve_task(f"jsonl:{path}").check_trainable()):
            done = {}
            worker = threading.Thread(target=lambda: done.setdefault("error", _error_of(call)), daemon=True)
            worker.start()
            worker.join(timeout=10)
            assert not worker.is_alive(), f"{path}: still reading"
            error = done["error"]
            assert isinstance(error, TaskFormatError), error
            check_one_line(str(error), path, None, words)
            assert "no such file" not in str(error)


def _error_of(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def write_csv(path: Path, rows: list[dict], prefix: bytes = b"") -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, ["id", "context", "question", "answer"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path.write_bytes(prefix + buffer.getvalue().encode("utf-8"))
    return path


def _rows_without_task(name: str, split: str) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "task"} for row in load_task(name, split).to_list()]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_byte_order_mark_is_read_as_without_it(fmt, tmp_path):
    rows = make_rows(12)
    write = write_csv if fmt == "csv" else write_jsonl
    plain = write(tmp_path / f"plain.{fmt}", rows)
    marked = tmp_path / f"marked.{fmt}"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    for split in SPLITS:
        assert _rows_without_task(f"{fmt}:{marked}", split) == _rows_without_task(f"{fmt}:{plain}", split)
    ids = [row["id"] for split in SPLITS for row in _rows_without_task(f"{fmt}:{marked}", split)]
    assert sorted(ids) == sorted(row["id"] for row in rows)  # the first column is "id", not "\ufeffid"


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_error_in_a_file_with_a_byte_order_mark_names_the_user_s_file(fmt, tmp_path):
    path = tmp_path / f"marked.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(b"\xef\xbb\xbf" + json.dumps(make_rows(1)[0]).encode() + b"\n{oops\n")
        line, words = 2, ["not a JSON object"]
    else:
        path.write_bytes(b"\xef\xbb\xbfcontext,question,answer\nc,q,a\nc,,a\n")
        line, words = 3, ["question is empty"]
    with pytest.raises(TaskFormatError) as caught:
        load_task(f"{fmt}:{path}", "train")
    check_one_line(str(caught.value), path, line, words)


def test_a_path_with_a_comma_stays_one_task_in_eval(tmp_path):
    path = write_jsonl(tmp_path / "my,notes.jsonl", make_rows(12))
    one = f"jsonl:{path}"
    assert split_task_names(one) == [one]
    assert split_task_names(f"babi:2,{one},squad") == ["babi:2", one, "squad"]
    args = build_eval_parser().parse_args(["--ckpt", str(tmp_path), "--tasks", f"{one},babi:1"])
    assert args.tasks == [one, "babi:1"]
    assert EvalConfig(tasks=f"babi:2,{one}").tasks == ["babi:2", one]
    per_split = f"jsonl:train={path},test={path}"
    assert split_task_names(f"babi:2,{per_split}") == ["babi:2", per_split]
    assert len(load_task(one, "test")) > 0
    from ilcp.evaluation.session import resolve_tasks
    assert [t.name for t in resolve_tasks("babi:1", f"{one},babi:2", only_extra=True)] == [one, "babi:2"]


def test_the_commands_refuse_a_5mb_question_in_one_line(tmp_path, tiny_run, capsys):
    """``ilcp-train`` (the file as its task) and ``ilcp-eval --tasks`` (in its test split): exit 2
    and one error line naming the file and the line, no traceback."""
    from ilcp import cli
    from test_task_files import cli_error

    path, line = one_huge_row(tmp_path, "question", split="test")
    (tmp_path / "train").mkdir()
    train_path, _ = one_huge_row(tmp_path / "train", "question")
    start = time.monotonic()
    code, error = cli_error(cli.train_main, ["--config", str(TINY), f"data.task=jsonl:{train_path}",
                                             f"out_dir={tmp_path / 'runs'}", f"lm.cache_dir={tmp_path / 'cache'}"],
                            capsys)
    assert code == 2 and f"{train_path}, line {line}: the question has 5,250,000 characters" in error, error
    code, error = cli_error(cli.eval_main, ["--ckpt", str(tiny_run.run_dir), "--tasks", f"jsonl:{path}",
                                            "--out", str(tmp_path / "results"), "--methods", "no_context"], capsys)
    assert code == 2 and f"{path}, line {line}: the question has 5,250,000 characters" in error, error
    assert time.monotonic() - start < 60
    assert not (tmp_path / "results").exists()

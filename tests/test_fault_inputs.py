"""Refusals found by a later fault campaign (docs/bad-inputs.md rows 153-168 and 179-180): a batch
of contexts bounded by its total characters before any is tokenised, eval's export key and output
folder, ``--resume`` on a last.ckpt that is not a checkpoint file, messages that name the right
file and remedy, and an export's LM checked by its fingerprint before its weights are read when it
is served. Each refusal is one line that names the thing at fault; nothing is written."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from ilcp import cli
from ilcp.export import ExportError, ExportLMError, sign_export
from ilcp.export_integrity import file_digest
from ilcp.handoff import MAX_SEND_CHARACTERS, ILCPHandoff
from ilcp.lm import LM, LMLoadError, build_tiny_qwen3
from ilcp.tasks import TaskFormatError, babi_file, parse_babi_file
from ilcp.export_integrity import redigest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
KEY = b"fault-campaign-export-key-012345"
QUICK = ["--limit", "1", "--latency-n", "0", "--lengths", "", "--facts-counts", "", "--no-progress",
         "--methods", "ilcp"]


def listing(*roots) -> dict[str, str]:
    """Every file (its sha256) and folder under the roots."""
    found = {}
    for root in map(Path, roots):
        for p in sorted(root.rglob("*")) if root.exists() else []:
            found[str(p)] = "/" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def run_cli(main, argv, capsys) -> tuple[int, list[str], str]:
    """A command line in-process: its exit code, its stderr lines that are neither argparse's
    usage nor ``[ilcp]`` progress, and the whole of stderr."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " ", "[ilcp]"))]
    return code, lines, err


def one_error_line(main, argv, capsys) -> str:
    code, lines, err = run_cli(main, argv, capsys)
    assert code == 2, err
    assert len(lines) == 1 and "error: " in lines[0], err
    return lines[0]


def copy_run(tiny_run, tmp_path, name="run") -> Path:
    return Path(shutil.copytree(tiny_run.run_dir, tmp_path / name))


def edit_config(run: Path, change) -> None:
    config = json.loads((run / "config.json").read_text())
    change(config)
    (run / "config.json").write_text(json.dumps(redigest(config)))  # its config_digest written anew


def forge_weights(run: Path) -> None:
    """Change model.safetensors and write its new sha256 into config.json (no key needed)."""
    state = load_file(str(run / "model.safetensors"))
    name = sorted(state)[0]
    state[name] = state[name] + 0.5
    save_file(state, str(run / "model.safetensors"), metadata={"format": "pt"})
    edit_config(run, lambda c: c["digests"].update({"model.safetensors": file_digest(run / "model.safetensors")}))


@pytest.fixture
def no_tokenizing(tiny_lm, monkeypatch):
    """Any call of the tiny LM's tokenizer (or its chat template) fails the test."""
    cls = type(tiny_lm.tokenizer)
    monkeypatch.setattr(cls, "__call__", lambda *a, **k: pytest.fail("the text was tokenised"), raising=False)
    monkeypatch.setattr(cls, "apply_chat_template", lambda *a, **k: pytest.fail("the chat template ran"),
                        raising=False)


# ------------------------------------------------------------------ ILCP sender: a batch's total


@pytest.fixture(scope="module")
def handoff(tiny_run, tiny_lm):
    return ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)


def test_a_batch_over_the_total_character_bound_is_refused_before_any_tokenising(handoff, no_tokenizing):
    one = "Mary went to the kitchen. " * 5_000  # 130,000 characters: under the per-context bound of 131,072
    assert len(one) <= handoff.lm.max_positions * 32
    with pytest.raises(ValueError) as info:
        handoff.send([one] * 100)
    message = str(info.value)
    assert "\n" not in message
    assert "13,000,000 characters" in message and f"max_characters={MAX_SEND_CHARACTERS:,}" in message
    assert "100 contexts" in message and "several calls" in message
    with pytest.raises(ValueError, match="max_characters=2,097,152"):
        handoff.send_each([one] * 100)
    with pytest.raises(ValueError, match="max_characters=2,097,152"):
        handoff.latents([one] * 100)


def test_the_total_bound_is_a_setting(handoff):
    contexts = ["Mary went to the kitchen.", "John took the milk."]
    with pytest.raises(ValueError, match="hold 44 characters together, more than max_characters=40"):
        handoff.send(contexts, max_characters=40)
    assert handoff.send(contexts, max_characters=44).latent.shape[0] == 2
    assert handoff.send(contexts, max_characters=None).latent.shape[0] == 2
    with pytest.raises(ValueError, match="max_characters must be a positive int"):
        handoff.send(contexts, max_characters=0)
    assert MAX_SEND_CHARACTERS == 2_097_152


# ------------------------------------------------------------------------ eval.py: the export key


@pytest.fixture
def signed(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path, "signed")
    sign_export(run, KEY)
    key_file = tmp_path / "export.key"
    key_file.write_bytes(KEY)
    return run, key_file


def test_eval_verifies_a_signed_export_with_its_key_file(signed, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ILCP_EXPORT_KEY_FILE", raising=False)
    run, key_file = signed
    out = tmp_path / "out"
    code, lines, err = run_cli(cli.eval_main, ["--ckpt", str(run), "--out", str(out), "--export-key-file",
                                               str(key_file), *QUICK], capsys)
    assert code == 0, err
    assert "unverified" not in err
    assert json.loads((out / "results.json").read_text())["run"]["export_verified"] is True


def test_eval_refuses_an_edited_and_redigested_signed_export(signed, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ILCP_EXPORT_KEY_FILE", raising=False)
    run, key_file = signed
    forge_weights(run)
    before = listing(tmp_path)
    line = one_error_line(cli.eval_main, ["--ckpt", str(run), "--out", str(tmp_path / "out"), "--export-key-file",
                                          str(key_file), *QUICK], capsys)
    assert "config.json: the signature does not verify" in line and str(run) in line
    assert listing(tmp_path) == before
    # the environment variable names the key file as well
    monkeypatch.setenv("ILCP_EXPORT_KEY_FILE", str(key_file))
    line = one_error_line(cli.eval_main, ["--ckpt", str(run), "--out", str(tmp_path / "out"), *QUICK], capsys)
    assert "the signature does not verify" in line
    assert listing(tmp_path) == before


def test_eval_without_a_key_says_in_one_line_that_the_export_is_unverified(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ILCP_EXPORT_KEY_FILE", raising=False)
    out = tmp_path / "out"
    code, lines, err = run_cli(cli.eval_main, ["--ckpt", str(tiny_run.run_dir), "--out", str(out), *QUICK], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "unverified" in line]
    assert len(notes) == 1 and "--export-key-file" in notes[0] and "ILCP_EXPORT_KEY_FILE" in notes[0], err
    assert json.loads((out / "results.json").read_text())["run"]["export_verified"] is False


@pytest.mark.parametrize("problem, words", [
    ("missing", ["missing.key", "does not exist"]),
    ("folder", ["is not a regular file"]),
    ("short", ["holds 5 bytes", "at least 16"]),
])
def test_a_bad_key_file_is_one_line_naming_it(tiny_run, tmp_path, capsys, monkeypatch, problem, words):
    monkeypatch.delenv("ILCP_EXPORT_KEY_FILE", raising=False)
    path = {"missing": tmp_path / "missing.key", "folder": tmp_path / "keys", "short": tmp_path / "short.key"}[problem]
    if problem == "folder":
        path.mkdir()
    elif problem == "short":
        path.write_bytes(b"12345")
    before = listing(tmp_path, tiny_run.run_dir)
    line = one_error_line(cli.eval_main, ["--ckpt", str(tiny_run.run_dir), "--out", str(tmp_path / "out"),
                                          "--export-key-file", str(path), *QUICK], capsys)
    assert "--export-key-file" in line
    for word in words:
        assert word in line, (word, line)
    assert listing(tmp_path, tiny_run.run_dir) == before
    monkeypatch.setenv("ILCP_EXPORT_KEY_FILE", str(path))
    line = one_error_line(cli.eval_main, ["--ckpt", str(tiny_run.run_dir), "--out", str(tmp_path / "out"), *QUICK],
                          capsys)
    assert "ILCP_EXPORT_KEY_FILE" in line


def test_eval_refuses_an_out_folder_inside_the_export(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path)
    before = listing(tmp_path)
    for out in (run, run / "results"):
        line = one_error_line(cli.eval_main, ["--ckpt", str(run), "--out", str(out), *QUICK], capsys)
        assert f"--out {str(out)!r} is inside the run folder" in line
    assert listing(tmp_path) == before


# ------------------------------------------------------------------ train.py --resume: last.ckpt


def resumable_copy(tiny_run, tmp_path) -> Path:
    """The tiny run copied to runs/tiny as if trained there, its prompt_tuned stage unfinished."""
    run = Path(shutil.copytree(tiny_run.run_dir, tmp_path / "runs" / "tiny"))
    saved = yaml.safe_load((run / "train_config.yaml").read_text())
    saved.update(out_dir=str(tmp_path / "runs"))
    (run / "train_config.yaml").write_text(yaml.safe_dump(saved))
    (run / "stages" / "prompt_tuned" / "prompt_tuned.safetensors").unlink()
    return run


def resume_argv(tmp_path) -> list[str]:
    return ["--config", str(TINY), "--resume", f"out_dir={tmp_path / 'runs'}", f"lm.cache_dir={tmp_path / 'cache'}"]


def make_folder(path: Path) -> None:
    path.mkdir()


def make_dangling_link(path: Path) -> None:
    path.symlink_to(path.parent / "gone.ckpt")


def make_pipe(path: Path) -> None:
    os.mkfifo(path)  # opening it would block: the refusal must come first


@pytest.mark.parametrize("make, kind", [
    pytest.param(make_folder, "a folder", id="a folder"),
    pytest.param(make_dangling_link, "a link to nothing", id="a link to nothing"),
    pytest.param(make_pipe, "a named pipe", id="a named pipe",
                 marks=pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")),
])
def test_resume_refuses_a_last_checkpoint_that_is_not_a_file(tiny_run, tmp_path, capsys, make, kind):
    ckpt = resumable_copy(tiny_run, tmp_path) / "stages" / "prompt_tuned" / "checkpoints" / "last.ckpt"
    ckpt.unlink()
    make(ckpt)
    before = listing(tmp_path) if kind == "a folder" else None
    line = one_error_line(cli.train_main, resume_argv(tmp_path), capsys)
    assert f"{ckpt} cannot be resumed from: it is {kind}, not a regular file" in line
    assert "--discard-last" in line
    if before is not None:
        assert listing(tmp_path) == before  # no last-v1.ckpt beside it, the stage not restarted


def test_resume_discard_last_starts_the_stage_again_past_a_folder_named_last_ckpt(tiny_run, tmp_path, capsys):
    run = resumable_copy(tiny_run, tmp_path)
    checkpoints = run / "stages" / "prompt_tuned" / "checkpoints"
    (checkpoints / "last.ckpt").unlink()
    (checkpoints / "last.ckpt").mkdir()
    code, lines, err = run_cli(cli.train_main, resume_argv(tmp_path) + ["--discard-last"], capsys)
    assert code == 0, err
    assert (run / "stages" / "prompt_tuned" / "prompt_tuned.safetensors").is_file()
    assert (checkpoints / "last.ckpt").is_file() and not (checkpoints / "last-v1.ckpt").exists()


def test_resume_calls_random_bytes_not_a_checkpoint(tiny_run, tmp_path, capsys):
    ckpt = resumable_copy(tiny_run, tmp_path) / "stages" / "prompt_tuned" / "checkpoints" / "last.ckpt"
    junk = bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8))
    ckpt.write_bytes(b"\x00" + junk[1:])  # anything but pickle's opening byte
    before = listing(tmp_path)
    line = one_error_line(cli.train_main, resume_argv(tmp_path), capsys)
    assert "it is not a checkpoint (neither the zip archive torch.save writes nor a pickle)" in line
    assert "pickled objects" not in line
    assert listing(tmp_path) == before


# ------------------------------------------------------------------------- bAbI files and remedies


def test_a_missing_babi_task_names_the_environment_variable_the_commands_read(tmp_path, monkeypatch):
    monkeypatch.delenv("ILCP_BABI_DIR", raising=False)
    with pytest.raises(FileNotFoundError) as info:
        babi_file(99, "test")
    message = str(info.value)
    assert "set ILCP_BABI_DIR" in message and "data_dir=" not in message and "\n" not in message
    (tmp_path / "en").mkdir()
    with pytest.raises(FileNotFoundError) as info:  # a library call that passed data_dir= is told about it
        babi_file(99, "test", data_dir=tmp_path)
    assert "point data_dir= at" in str(info.value) and "ILCP_BABI_DIR" not in str(info.value)


def test_train_and_eval_name_ilcp_babi_dir_for_a_missing_task(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ILCP_BABI_DIR", raising=False)
    line = one_error_line(cli.train_main, ["--config", str(TINY), "data.task=babi:99", f"out_dir={tmp_path / 'runs'}"],
                          capsys)
    assert "set ILCP_BABI_DIR" in line and "data_dir=" not in line
    line = one_error_line(cli.eval_main, ["--ckpt", str(tiny_run.run_dir), "--out", str(tmp_path / "out"), "--tasks",
                                          "babi:99", *QUICK], capsys)
    assert "set ILCP_BABI_DIR" in line and "data_dir=" not in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_a_babi_file_with_binary_junk_names_the_file_and_line(tmp_path):
    path = tmp_path / "en" / "qa1_single-supporting-fact_train.txt"
    path.parent.mkdir()
    path.write_bytes(b"1 Mary moved to the bathroom.\n2 Where is Mary?\tbathroom\t1\n\xff\xfe\x00junk\x9c\n")
    with pytest.raises(TaskFormatError) as info:
        parse_babi_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: not UTF-8 text (byte 0xff at column 1)") and "\n" not in message


def test_train_names_a_babi_file_with_binary_junk(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "babi" / "en"
    folder.mkdir(parents=True)
    shutil.copy(REPO / "data" / "babi" / "en" / "qa1_single-supporting-fact_test.txt", folder)
    (folder / "qa1_single-supporting-fact_train.txt").write_bytes(b"\xff\xfe" + bytes(range(256)) * 4)
    monkeypatch.setenv("ILCP_BABI_DIR", str(tmp_path / "babi"))
    line = one_error_line(cli.train_main, ["--config", str(TINY), "data.task=babi:1", f"out_dir={tmp_path / 'runs'}",
                                           f"lm.cache_dir={tmp_path / 'cache'}"], capsys)
    assert "qa1_single-supporting-fact_train.txt, line 1: not UTF-8 text" in line
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------ export refusals


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_named_pipe_as_weights_is_not_called_missing(tiny_run, tiny_lm, tmp_path):
    run = copy_run(tiny_run, tmp_path)
    (run / "model.safetensors").unlink()
    os.mkfifo(run / "model.safetensors")
    with pytest.raises(ExportError) as info:  # would block if the pipe were opened
        ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    message = str(info.value)
    assert message == (f"{run / 'model.safetensors'} is listed in config.json but is a named pipe, not a regular "
                       "file: copy the export's weights file there")


def test_an_export_of_another_lm_is_refused_by_its_fingerprint_before_its_tensors(tiny_run, tiny_lm, tmp_path):
    """An export whose soft prompt does not fit (K+1, H), given an LM with the same hidden size and
    other weights: the fingerprint is what names the mistake, so it is checked first."""
    run = copy_run(tiny_run, tmp_path)
    state = load_file(str(run / "prompt_tuned.safetensors"))
    name = next(iter(state))
    state[name] = torch.cat([state[name], state[name][:1]])
    save_file(state, str(run / "prompt_tuned.safetensors"))
    edit_config(run, lambda c: c["digests"].update(
        {"prompt_tuned.safetensors": file_digest(run / "prompt_tuned.safetensors")}))
    model, tokenizer = build_tiny_qwen3(seed=1)
    other = LM(model=model.eval(), tokenizer=tokenizer, spec="tiny-qwen3")
    assert other.hidden_size == tiny_lm.hidden_size and other.fingerprint != tiny_lm.fingerprint
    with pytest.raises(ExportError) as info:
        ILCPHandoff.from_pretrained(run, lm=other)
    assert "trained on LM 'tiny-qwen3' with fingerprint" in str(info.value) and "shape" not in str(info.value)
    with pytest.raises(ExportError) as info:
        ILCPHandoff.from_pretrained(run, lm=model, tokenizer=tokenizer)
    assert f"the LM given has fingerprint {other.fingerprint}" in str(info.value)
    with pytest.raises(ExportError, match="prompt_tuned.safetensors: soft_prompt has shape"):
        ILCPHandoff.from_pretrained(run, lm=tiny_lm)  # the same LM: the tensor's own fault is named


def saved_lm(model, tokenizer, directory: Path) -> Path:
    """A model directory as `python -m ilcp serve --model-dir` reads it."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def spoil_weights(run: Path) -> None:
    """Flip a byte of model.safetensors, leaving its digest in config.json as it was."""
    data = bytearray((run / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (run / "model.safetensors").write_bytes(bytes(data))


def test_serve_names_another_lm_by_its_fingerprint_before_reading_any_weights(tiny_run, tiny_lm, tmp_path):
    """`serve_command` with another LM's directory: the fingerprint is the refusal, even when the
    export's weights file is spoiled too (it was never read); the run's own LM then meets the
    spoiled file, so the export is still read whole before it is served."""
    from ilcp.engines.serve import serve_command

    run = copy_run(tiny_run, tmp_path)
    spoil_weights(run)
    model, tokenizer = build_tiny_qwen3(seed=1)
    other = saved_lm(model, tokenizer, tmp_path / "other-lm")
    with pytest.raises(ExportError, match="trained on LM 'tiny-qwen3' with fingerprint") as info:
        serve_command(run, model_dir=other)
    assert "model.safetensors" not in str(info.value)
    same = saved_lm(tiny_lm.model, tiny_lm.tokenizer, tmp_path / "same-lm")
    with pytest.raises(ExportError, match="model.safetensors"):
        serve_command(run, model_dir=same)
    command = serve_command(tiny_run.run_dir, model_dir=same, port=8123)
    assert command[command.index("--model") + 1] == str(same) and "--enable-prompt-embeds" in command


def test_a_served_receiver_names_a_server_of_another_lm_before_reading_any_weights(tiny_run, tiny_lm, tmp_path):
    """`ServedReceiver.from_pretrained` against a server that serves another LM's fingerprint: the
    mismatch is the refusal, before the (spoiled) weights file of the export is read."""
    import http.server
    import threading

    from ilcp.engines.embedding_table import served_model_name, table_digest
    from ilcp.engines.served import ModelMismatchError, ServedReceiver

    run = copy_run(tiny_run, tmp_path)
    spoil_weights(run)
    directory = saved_lm(tiny_lm.model, tiny_lm.tokenizer, tmp_path / "lm")
    name = served_model_name("0123456789abcdef", table_digest(tiny_lm.model.get_input_embeddings().weight,
                                                                tiny_lm.tokenizer))

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": name, "max_model_len": 512}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with pytest.raises(ModelMismatchError, match="serves LM 0123456789abcdef"):
            ServedReceiver.from_pretrained(run, url, model_dir=directory, timeout=10)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", [None, 5, b"checkpoints/tiny", ""])
def test_from_pretrained_of_no_path_is_an_export_error(path):
    with pytest.raises(ExportError) as info:
        ILCPHandoff.from_pretrained(path)
    message = str(info.value)
    assert "an export is a run folder such as 'checkpoints/default'" in message and "\n" not in message


@pytest.mark.parametrize("entry, value, words", [
    ("spec", "no-such-lm", ["lm.spec 'no-such-lm'", "unknown LM spec 'no-such-lm'"]),
    ("dtype", "int8", ["lm.dtype 'int8'", "unknown dtype 'int8'"]),
])
def test_an_unloadable_lm_in_an_export_is_an_export_error(tiny_run, tmp_path, entry, value, words):
    run = copy_run(tiny_run, tmp_path)
    edit_config(run, lambda c: c["lm"].update({entry: value}))
    with pytest.raises(ExportError) as info:
        ILCPHandoff.from_pretrained(run)
    assert isinstance(info.value, ExportLMError) and isinstance(info.value, LMLoadError)  # both still catch it
    message = str(info.value)
    assert message.startswith(f"{run / 'config.json'}: the LM it names") and "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_a_dtype_that_is_not_a_string_is_refused_by_the_schema(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path)
    edit_config(run, lambda c: c["lm"].update({"dtype": 5}))
    with pytest.raises(ExportError, match="lm.dtype"):
        ILCPHandoff.from_pretrained(run)


def test_eval_names_an_unloadable_lm_of_the_export(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path)
    edit_config(run, lambda c: c["lm"].update({"dtype": "int8"}))
    line = one_error_line(cli.eval_main, ["--ckpt", str(run), "--out", str(tmp_path / "out"), *QUICK], capsys)
    assert "config.json: the LM it names" in line and "unknown dtype 'int8'" in line
    assert not (tmp_path / "out").exists()


def test_the_server_runs_in_the_runs_compute_dtype_unless_told(tiny_run, tiny_lm, tmp_path, capsys):
    """`serve_command`'s ``--dtype``: bfloat16 for a run trained at bf16-mixed, the LM's dtype at
    32-true (the tiny run), what ``dtype=`` / ``--dtype`` say otherwise; a bad name is refused."""
    from ilcp.engines.serve import serve_command, serve_dtype

    assert serve_dtype({"lm": {"dtype": "float32", "precision": "bf16-mixed"}}) == "bfloat16"
    assert serve_dtype({"lm": {"dtype": "float32", "precision": "32-true"}}) == "float32"
    assert serve_dtype({"lm": {"dtype": "float32"}}) == "float32"  # an export from before precision was recorded
    assert serve_dtype({"lm": {"dtype": "float16", "precision": "bf16-mixed"}}) == "float16"
    same = saved_lm(tiny_lm.model, tiny_lm.tokenizer, tmp_path / "same-lm")

    def dtype_of(command):
        return command[command.index("--dtype") + 1]

    assert dtype_of(serve_command(tiny_run.run_dir, model_dir=same)) == "float32"
    assert dtype_of(serve_command(tiny_run.run_dir, model_dir=same, dtype="bfloat16")) == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        serve_command(tiny_run.run_dir, model_dir=same, dtype="int8")
    assert cli.main(["serve", str(tiny_run.run_dir), "--model-dir", str(same), "--dtype", "bfloat16", "--print"]) == 0
    assert "--dtype bfloat16" in capsys.readouterr().out

"""The bad-input catalogue of docs/bad-inputs.md, one parametrised test per entry point.

Every case checks three things: the error (exit code 2 and one ``error:`` line on stderr, no
traceback, for a command line; a specific exception class with a one-line message for the API),
that the message names the offending thing, and that nothing was written or lost (every file
and folder under the test's folder and the shared tiny run, with its sha256, is the same after).

Each case is a small function that prepares what it needs under ``s.tmp`` and returns the argv
(command lines) or the call that must fail (API); the listing is taken between the two.
"""

import asyncio
import hashlib
import json
import shutil
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ilcp import cli, rclc
from ilcp.export import ExportError, read_export, sign_export
from ilcp.export_integrity import file_digest
from ilcp.handoff import ILCPHandoff
from ilcp.lm import build_tiny_qwen3
from ilcp.rclc import SnapshotError
from ilcp.rclc.snapshot import content_digest, write_snapshot
from ilcp.wire.payload import PayloadError, pack
from ilcp.wire.seal import SEAL_MAGIC, seal
from ilcp.export_integrity import redigest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
KEY = b"k" * 32


def listing(*roots) -> dict[str, str]:
    """Every file (its sha256) and folder ("/") under the roots: equal before and after means
    nothing was written, changed or deleted."""
    found = {}
    for root in map(Path, roots):
        for p in sorted(root.rglob("*")) if root.exists() else []:
            found[str(p)] = "/" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def cli_error(main, argv, capsys) -> tuple[int, str]:
    """Run a command line in-process; returns its exit code and its one error line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    # Above the error argparse prints its usage synopsis (continuation lines indented) and a
    # command may log "[ilcp] ..." progress lines; what is left is the error, on one line.
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith(("usage:", " ", "[ilcp]"))]
    assert len(lines) == 1 and "error: " in lines[0], err
    return code, lines[0]


def register(table: dict, name: str, *expected):
    """Decorator: a case of `table`, with what the test expects (words, or an error class and words)."""
    def add(prepare):
        table[name] = (prepare, expected)
        return prepare
    return add


def copy_run(s, name="run") -> Path:
    return Path(shutil.copytree(s.run, s.tmp / name))


def edit_config(run: Path, change) -> None:
    config = json.loads((run / "config.json").read_text())
    change(config)
    (run / "config.json").write_text(json.dumps(redigest(config)))  # its config_digest written anew


def edit_weights(run: Path, change) -> None:
    """Change model.safetensors and write its new sha256 into config.json, as an attacker would:
    the digest alone cannot tell (only a signature under a key can)."""
    state = load_file(str(run / "model.safetensors"))
    change(state)
    save_file(state, str(run / "model.safetensors"), metadata={"format": "pt"})
    edit_config(run, lambda c: c["digests"].update({"model.safetensors": file_digest(run / "model.safetensors")}))


# ------------------------------------------------------------------ python train.py / ilcp-train

TRAIN: dict = {}
train_case = partial(register, TRAIN)


def runs(s) -> list[str]:
    """Overrides that keep everything a start might write inside the test's folder."""
    return [f"out_dir={s.tmp / 'runs'}", f"lm.cache_dir={s.tmp / 'cache'}"]


@train_case("config file missing", "missing.yaml", "does not exist")
def _(s):
    return ["--config", str(s.tmp / "missing.yaml"), *runs(s)]


@train_case("config is a folder", "is a directory")
def _(s):
    return ["--config", str(s.tmp), *runs(s)]


@train_case("config is not YAML", "bad.yaml", "is not valid YAML", "line 2")
def _(s):
    (s.tmp / "bad.yaml").write_text("run_name: [unclosed\n")
    return ["--config", str(s.tmp / "bad.yaml"), *runs(s)]


@train_case("config holds a list", "list.yaml", "must hold a mapping")
def _(s):
    (s.tmp / "list.yaml").write_text("- a\n- b\n")
    return ["--config", str(s.tmp / "list.yaml"), *runs(s)]


@train_case("override is not YAML", "handoff.variants=[ilcp", "is not valid YAML")
def _(s):
    return ["--config", str(TINY), *runs(s), "handoff.variants=[ilcp"]


@train_case("override without =", "handoff.max_steps", "key=value")
def _(s):
    return ["--config", str(TINY), *runs(s), "handoff.max_steps"]


@train_case("unknown key", "handoff.max_stepz")
def _(s):
    return ["--config", str(TINY), *runs(s), "handoff.max_stepz=3"]


@train_case("wrong type", "handoff.max_steps", "'abc'")
def _(s):
    return ["--config", str(TINY), *runs(s), "handoff.max_steps=abc"]


@train_case("negative steps", "handoff.max_steps", "-5")
def _(s):
    return ["--config", str(TINY), *runs(s), "handoff.max_steps=-5"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


GOOD_ROW = {"context": "Mary went to the kitchen.", "question": "Where is Mary?", "answer": "kitchen"}


@train_case("task file missing", "data.task", "missing.jsonl", "no such file")
def _(s):
    return ["--config", str(TINY), *runs(s), f"data.task=jsonl:{s.tmp / 'missing.jsonl'}"]


@train_case("task file lacks a column", "notes.jsonl", "missing column(s) context", "passage")
def _(s):
    path = write_jsonl(s.tmp / "notes.jsonl", [{"passage": "Mary went home.", "question": "Where?", "answer": "home"}])
    return ["--config", str(TINY), *runs(s), f"data.task=jsonl:{path}"]


@train_case("task file: empty question", "notes.jsonl, line 3", "question is empty")
def _(s):
    path = write_jsonl(s.tmp / "notes.jsonl", [GOOD_ROW] * 2 + [{**GOOD_ROW, "question": " "}])
    return ["--config", str(TINY), *runs(s), f"data.task=jsonl:{path}"]


@train_case("task file: a number as answer", "notes.parquet, row 1", "answer must be a string", "int")
def _(s):
    import datasets

    datasets.Dataset.from_dict({"context": [GOOD_ROW["context"]] * 2, "question": [GOOD_ROW["question"]] * 2,
                                "answer": [1, 7]}).to_parquet(str(s.tmp / "notes.parquet"))
    return ["--config", str(TINY), *runs(s), f"data.task=parquet:{s.tmp / 'notes.parquet'}"]


@train_case("task file: empty CSV field", "notes.csv, line 3", "answer is empty")
def _(s):
    (s.tmp / "notes.csv").write_text("context,question,answer\nMary went home.,Where is Mary?,home\n"
                                     "John left.,Who left?,\n")
    return ["--config", str(TINY), *runs(s), f"data.task=csv:{s.tmp / 'notes.csv'}"]


@train_case("task file: no train split", "notes.jsonl", "no train split")
def _(s):
    path = write_jsonl(s.tmp / "notes.jsonl", [{**GOOD_ROW, "split": "test"}] * 3)
    return ["--config", str(TINY), *runs(s), f"data.task=jsonl:{path}"]


@train_case("task file: context over the LM's limit", "notes.jsonl, line 2", "longer than the LM's limit of 4,096")
def _(s):
    path = write_jsonl(s.tmp / "notes.jsonl", [GOOD_ROW, {**GOOD_ROW, "context": "Mary went home. " * 2000}])
    return ["--config", str(TINY), *runs(s), f"data.task=jsonl:{path}", "data.validation_fraction=0"]


@train_case("unknown task", "data.task", "trivia")
def _(s):
    return ["--config", str(TINY), *runs(s), "data.task=trivia"]


@train_case("bAbI task not shipped", "qa99", "tasks available there")
def _(s):
    return ["--config", str(TINY), *runs(s), "data.task=babi:99"]


@train_case("unknown LM spec", "no-such-lm")
def _(s):
    return ["--config", str(TINY), *runs(s), "lm.spec=no-such-lm"]


@train_case("run_name is a path", "run_name", "../x")
def _(s):
    return ["--config", str(TINY), *runs(s), "run_name=../x"]


@train_case("run exists without --overwrite", "already holds a run", "--resume")
def _(s):
    shutil.copytree(s.run, s.tmp / "runs" / "tiny")
    return ["--config", str(TINY), *runs(s)]


@train_case("--overwrite on a folder that is not a run", "not a run directory", "nothing was deleted")
def _(s):
    (s.tmp / "runs" / "tiny").mkdir(parents=True)
    (s.tmp / "runs" / "tiny" / "notes.txt").write_text("mine")
    return ["--config", str(TINY), "--overwrite", *runs(s)]


@train_case("--resume with changed settings", "(compressor.latent_dim: 8 -> 16)")
def _(s):
    run = Path(shutil.copytree(s.run, s.tmp / "runs" / "tiny"))
    saved = yaml.safe_load((run / "train_config.yaml").read_text())
    saved.update(out_dir=str(s.tmp / "runs"))  # as if trained here: only latent_dim differs
    (run / "train_config.yaml").write_text(yaml.safe_dump(saved))
    return ["--config", str(TINY), "--resume", *runs(s), "compressor.latent_dim=16"]


@train_case("python -m ilcp with an unknown command", "'fit'", "{train,eval,serve}")
def _(s):
    s.main = cli.main
    return ["fit", "--config", str(TINY)]


def resumable_copy(s) -> Path:
    """The tiny run copied to runs/tiny as if trained there, with its prompt_tuned stage unfinished."""
    run = Path(shutil.copytree(s.run, s.tmp / "runs" / "tiny"))
    saved = yaml.safe_load((run / "train_config.yaml").read_text())
    saved.update(out_dir=str(s.tmp / "runs"))
    (run / "train_config.yaml").write_text(yaml.safe_dump(saved))
    (run / "stages" / "prompt_tuned" / "prompt_tuned.safetensors").unlink()
    return run


class CodeOnLoad:
    """A pickled object whose loading would create a file: a checkpoint carrying code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@train_case("trainer.accelerator=tpu without torch_xla", "trainer.accelerator", "torch_xla")
def _(s):
    return ["--config", str(TINY), *runs(s), "trainer.accelerator=tpu"]


@train_case("trainer.accelerator unknown", "trainer.accelerator", "'abacus'")
def _(s):
    return ["--config", str(TINY), *runs(s), "trainer.accelerator=abacus"]


@train_case("trainer.accelerator=gpu without a GPU", "trainer.accelerator=gpu", "no CUDA GPU")
def _(s):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    return ["--config", str(TINY), *runs(s), "trainer.accelerator=gpu"]


@train_case("trainer.devices=abc", "trainer.devices", "'abc'")
def _(s):
    return ["--config", str(TINY), *runs(s), "trainer.devices=abc"]


@train_case("data.pool_layers=[99]", "data.pool_layers", "[99]", "hidden states")
def _(s):
    return ["--config", str(TINY), *runs(s), "data.pool_layers=[99]"]


@train_case("out_dir is an existing file", "notes.txt", "is a file")
def _(s):
    (s.tmp / "notes.txt").write_text("mine")
    return ["--config", str(TINY), f"out_dir={s.tmp / 'notes.txt'}", f"lm.cache_dir={s.tmp / 'cache'}"]


@train_case("--resume on a run that does not exist", "--resume", "holds no run to resume")
def _(s):
    return ["--config", str(TINY), "--resume", *runs(s)]


@train_case("--discard-last without --resume", "--discard-last", "--resume")
def _(s):
    return ["--config", str(TINY), "--discard-last", *runs(s)]


@train_case("--resume with a truncated last.ckpt", "prompt_tuned/checkpoints/last.ckpt", "truncated",
            "--resume --discard-last")
def _(s):
    ckpt = resumable_copy(s) / "stages" / "prompt_tuned" / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    return ["--config", str(TINY), "--resume", *runs(s)]


@train_case("--resume with a last.ckpt that carries code", "last.ckpt", "refused unread", "--discard-last")
def _(s):
    ckpt = resumable_copy(s) / "stages" / "prompt_tuned" / "checkpoints" / "last.ckpt"
    torch.save({"state_dict": {}, "hook": CodeOnLoad(s.tmp / "ran.txt")}, ckpt)
    return ["--config", str(TINY), "--resume", *runs(s)]  # ran.txt appearing would fail the listing


@pytest.mark.parametrize("case", list(TRAIN))
def test_train_command_refuses(case, tiny_run, tmp_path, capsys):
    prepare, words = TRAIN[case]
    s = SimpleNamespace(tmp=tmp_path, run=tiny_run.run_dir, main=cli.train_main)
    argv = prepare(s)
    before = listing(tmp_path, tiny_run.run_dir)
    code, line = cli_error(s.main, argv, capsys)
    assert code == 2
    for word in words:
        assert word in line, (word, line)
    assert listing(tmp_path, tiny_run.run_dir) == before


# -------------------------------------------------------------------- python eval.py / ilcp-eval

EVAL: dict = {}
eval_case = partial(register, EVAL)


@eval_case("no --ckpt", "--ckpt")
def _(s):
    return []


@eval_case("--ckpt missing", "nope", "is not a directory")
def _(s):
    return ["--ckpt", str(s.tmp / "nope")]


@eval_case("--ckpt is not a run", "empty", "no config.json")
def _(s):
    (s.tmp / "empty").mkdir()
    return ["--ckpt", str(s.tmp / "empty")]


@eval_case("unknown method", "'telepathy'")
def _(s):
    return ["--ckpt", str(s.run), "--methods", "ilcp,telepathy"]


@eval_case("unknown RCLC selector", "unknown selector 'magic'")
def _(s):
    return ["--ckpt", str(s.run), "--methods", "rclc:magic:r4"]


@eval_case("bad RCLC budget string", "budget 'x4'")
def _(s):
    return ["--ckpt", str(s.run), "--methods", "rclc:cacheback:x4"]


@eval_case("unknown task", "'trivia'")
def _(s):
    return ["--ckpt", str(s.run), "--tasks", "trivia"]


@eval_case("unknown --split", "invalid choice: 'train'")
def _(s):
    return ["--ckpt", str(s.run), "--split", "train"]


@eval_case("held-out facts at the validation split", "'facts-heldout'", "only its test split holds")
def _(s):
    return ["--ckpt", str(s.run), "--split", "validation", "--only-tasks", "--tasks", "facts-heldout"]


@eval_case("bAbI task not shipped", "babi:99")
def _(s):
    return ["--ckpt", str(s.run), "--tasks", "babi:99"]


@eval_case("task file missing", "missing.jsonl", "no such file")
def _(s):
    return ["--ckpt", str(s.run), "--tasks", f"jsonl:{s.tmp / 'missing.jsonl'}"]


@eval_case("task file lacks a column", "notes.jsonl", "missing column(s) answer", "gold")
def _(s):
    path = write_jsonl(s.tmp / "notes.jsonl", [{"context": "Mary went home.", "question": "Where?", "gold": "home"}])
    return ["--ckpt", str(s.run), "--tasks", f"jsonl:{path}"]


@eval_case("task file: a line is not JSON", "notes.jsonl, line 2", "not a JSON object")
def _(s):
    path = s.tmp / "notes.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n{context: oops\n")
    return ["--ckpt", str(s.run), "--tasks", f"jsonl:{path}"]


@eval_case("negative --limit", "limit", "-3")
def _(s):
    return ["--ckpt", str(s.run), "--limit", "-3"]


@eval_case("--limit not a number", "--limit", "'abc'")
def _(s):
    return ["--ckpt", str(s.run), "--limit", "abc"]


@eval_case("--batch-size 0", "batch_size", "0")
def _(s):
    return ["--ckpt", str(s.run), "--batch-size", "0"]


@eval_case("--lengths not numbers", "'a,b'")
def _(s):
    return ["--ckpt", str(s.run), "--lengths", "a,b"]


@eval_case("unknown --payload-dtype", "'int4'")
def _(s):
    return ["--ckpt", str(s.run), "--payload-dtype", "int4"]


@eval_case("unknown --device", "'banana'")
def _(s):
    return ["--ckpt", str(s.run), "--device", "banana"]


@eval_case("--out is a file", "results.txt", "is a file")
def _(s):
    (s.tmp / "results.txt").write_text("earlier results")
    return ["--ckpt", str(s.run), "--out", str(s.tmp / "results.txt")]


@eval_case("config.json is not JSON", "config.json", "not valid JSON")
def _(s):
    run = copy_run(s)
    (run / "config.json").write_text("{oops")
    return ["--ckpt", str(run)]


@eval_case("weights changed after export", "model.safetensors", "changed after export")
def _(s):
    run = copy_run(s)
    data = bytearray((run / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (run / "model.safetensors").write_bytes(bytes(data))
    return ["--ckpt", str(run)]


@eval_case("export of another LM", "fingerprint 0123456789abcdef")
def _(s):
    run = copy_run(s)
    edit_config(run, lambda c: c["lm"].update(fingerprint="0123456789abcdef"))
    return ["--ckpt", str(run)]


@eval_case("export names an unknown LM", "no-such-lm")
def _(s):
    run = copy_run(s)
    edit_config(run, lambda c: c["lm"].update(spec="no-such-lm"))
    return ["--ckpt", str(run)]


@eval_case("--device cuda without a GPU", "--device 'cuda'", "no CUDA GPU")
def _(s):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    return ["--ckpt", str(s.run), "--device", "cuda"]


@eval_case("--tasks ','", "--tasks", "','")
def _(s):
    return ["--ckpt", str(s.run), "--tasks", ","]


@eval_case("--methods ' , '", "--methods", "' , '")
def _(s):
    return ["--ckpt", str(s.run), "--methods", " , "]


@eval_case("corrupt metrics.json", "metrics.json", "not valid JSON")
def _(s):
    run = copy_run(s)
    (run / "metrics.json").write_text('{"variants": ')
    return ["--ckpt", str(run)]


@eval_case("corrupt train_config.yaml", "train_config.yaml", "not valid YAML")
def _(s):
    run = copy_run(s)
    (run / "train_config.yaml").write_text("handoff: [unclosed\n")
    return ["--ckpt", str(run)]


@pytest.mark.parametrize("case", list(EVAL))
def test_eval_command_refuses(case, tiny_run, tmp_path, capsys):
    prepare, words = EVAL[case]
    s = SimpleNamespace(tmp=tmp_path, run=tiny_run.run_dir)
    # Small settings first (a case's own flags come later and win): were a case let through, it
    # would still end in seconds, and fail on the files it wrote.
    quick = ["--limit", "1", "--latency-n", "0", "--lengths", "", "--no-progress", "--out", str(tmp_path / "out")]
    argv = quick + prepare(s)
    before = listing(tmp_path, tiny_run.run_dir)
    code, line = cli_error(cli.eval_main, argv, capsys)
    assert code == 2
    for word in words:
        assert word in line, (word, line)
    assert listing(tmp_path, tiny_run.run_dir) == before


# ---------------------------------------------------------------------------------- ILCPHandoff

HANDOFF: dict = {}
handoff_case = partial(register, HANDOFF)
QUESTION = "Where is Mary?"


@pytest.fixture(scope="module")
def handoff(tiny_run, tiny_lm):
    return ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)


@pytest.fixture(scope="module")
def wire(handoff) -> bytes:
    return handoff.send("Mary went to the kitchen. John went to the garden.").to_bytes()


@handoff_case("from_pretrained on a missing folder", ExportError, "nope", "not a directory")
def _(s):
    return lambda: ILCPHandoff.from_pretrained(s.tmp / "nope", lm=s.lm)


@handoff_case("from_pretrained on a folder that is not a run", ExportError, "no config.json")
def _(s):
    (s.tmp / "empty").mkdir()
    return lambda: ILCPHandoff.from_pretrained(s.tmp / "empty", lm=s.lm)


@handoff_case("from_pretrained with another LM", ExportError, "fingerprint")
def _(s):
    model, tokenizer = build_tiny_qwen3(seed=1)  # same architecture, other weights
    return lambda: ILCPHandoff.from_pretrained(s.run, lm=model.eval(), tokenizer=tokenizer)


@handoff_case("from_pretrained with an LM name", ValueError, "got str")
def _(s):
    return lambda: ILCPHandoff.from_pretrained(s.run, lm="tiny-qwen3")


@handoff_case("from_pretrained with a bare model and no tokenizer", ValueError, "tokenizer")
def _(s):
    return lambda: ILCPHandoff.from_pretrained(s.run, lm=s.lm.model)


@handoff_case("unknown payload_dtype", ValueError, "'int4'")
def _(s):
    return lambda: ILCPHandoff.from_pretrained(s.run, lm=s.lm, payload_dtype="int4")


@handoff_case("auth_key too short", ValueError, "key", ">= 16")
def _(s):
    return lambda: ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=b"short")


@handoff_case("receive truncated bytes", PayloadError, "truncated")
def _(s):
    return lambda: s.h.receive(s.wire[:-5], QUESTION)


@handoff_case("receive bytes with one bit flipped", PayloadError, "CRC")
def _(s):
    damaged = bytearray(s.wire)
    damaged[20] ^= 0x01
    return lambda: s.h.receive(bytes(damaged), QUESTION)


@handoff_case("receive bytes that are no payload", PayloadError, "not an ILCP payload")
def _(s):
    return lambda: s.h.receive(b"hello, this is not a payload", QUESTION)


@handoff_case("receive a string", PayloadError, "got str")
def _(s):
    return lambda: s.h.receive(s.wire.hex(), QUESTION)


@handoff_case("receive a payload of another LM", PayloadError, "made by LM 0123456789abcdef")
def _(s):
    foreign = pack(torch.zeros(s.h.latent_dim), lm_fingerprint="0123456789abcdef").to_bytes()
    return lambda: s.h.receive(foreign, QUESTION)


@handoff_case("receive a latent of the wrong shape", PayloadError, "shape (9,)", "Z = 8")
def _(s):
    wide = pack(torch.zeros(s.h.latent_dim + 1), lm_fingerprint=s.h.fingerprint).to_bytes()
    return lambda: s.h.receive(wide, QUESTION)


@handoff_case("empty question", ValueError, "question", "empty")
def _(s):
    return lambda: s.h.receive(s.wire, "   ")


@handoff_case("overlong question", ValueError, "positions", "shorten the question")
def _(s):
    return lambda: s.h.receive(s.wire, "why " * (s.lm.model.config.max_position_embeddings + 1))


@handoff_case("more questions than latents", ValueError, "1 latent(s)", "2 question(s)")
def _(s):
    return lambda: s.h.receive(s.wire, [QUESTION, "Where is John?"])


@handoff_case("max_new_tokens 0", ValueError, "max_new_tokens")
def _(s):
    return lambda: s.h.receive(s.wire, QUESTION, max_new_tokens=0)


@handoff_case("unauthenticated payload when a key is set", PayloadError, "not authenticated")
def _(s):
    keyed = ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=b"k" * 32)
    return lambda: keyed.receive(s.wire, QUESTION)


@handoff_case("payload sealed with another key", PayloadError, "authentication failed")
def _(s):
    sealed = s.h.send("Mary went to the kitchen.").to_bytes(b"k" * 32)
    other = ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=b"j" * 32)
    return lambda: other.receive(sealed, QUESTION)


@handoff_case("send an empty context", ValueError, "empty context")
def _(s):
    return lambda: s.h.send("")


@handoff_case("save_pretrained onto a file", FileExistsError, "handoff.txt", "is a file")
def _(s):
    (s.tmp / "handoff.txt").write_text("notes")
    return lambda: s.h.save_pretrained(s.tmp / "handoff.txt")


@handoff_case("save_pretrained into a training run", FileExistsError, "training run", "nothing was written")
def _(s):
    run = copy_run(s)
    return lambda: s.h.save_pretrained(run)


@handoff_case("save_pretrained into a model's folder", FileExistsError, "lm-folder", "nothing was written")
def _(s):
    s.lm.model.save_pretrained(s.tmp / "lm-folder")
    return lambda: s.h.save_pretrained(s.tmp / "lm-folder")


@handoff_case("receive a payload of 100,000 latents for one question", PayloadError, "100000 latent(s)",
              "1 question(s)")
def _(s):
    huge = pack(torch.zeros(100_000, s.h.latent_dim), lm_fingerprint=s.h.fingerprint).to_bytes()
    return lambda: s.h.receive(huge, QUESTION)


@handoff_case("receive(wire, None)", ValueError, "question", "got NoneType")
def _(s):
    return lambda: s.h.receive(s.wire, None)


@handoff_case("receive(wire, 5)", ValueError, "question", "got int")
def _(s):
    return lambda: s.h.receive(s.wire, 5)


@handoff_case("question with a lone surrogate", ValueError, "lone surrogate", "'\\ud800'")
def _(s):
    return lambda: s.h.receive(s.wire, "Where is \ud800 Mary?")


@handoff_case("10-million-character question", ValueError, "10,000,000 characters", "shorten it")
def _(s):
    return lambda: s.h.receive(s.wire, "why " * 2_500_000)


@handoff_case("send a 10-million-character context", ValueError, "10,000,000 characters", "shorten it")
def _(s):
    return lambda: s.h.send("Mary went " * 1_000_000)


@handoff_case("send a context with a lone surrogate", ValueError, "lone surrogate")
def _(s):
    return lambda: s.h.send("Mary went to the \udfff kitchen.")


@handoff_case("send a context of only whitespace", ValueError, "only whitespace")
def _(s):
    return lambda: s.h.send("   \n ")


@handoff_case("send_from_hidden_states with an all-zero mask", ValueError, "no real token")
def _(s):
    ids = s.h.sender_inputs(["Mary went to the kitchen."])
    with torch.no_grad():
        outputs = s.lm.model(**ids, output_hidden_states=True)
    return lambda: s.h.send_from_hidden_states(outputs, torch.zeros_like(ids["attention_mask"]))


@handoff_case("a TransportPayload object to a receiver with a key", PayloadError, "not authenticated", "to_wire")
def _(s):
    keyed = ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=KEY)
    payload = keyed.send("Mary went to the kitchen.")
    return lambda: keyed.receive(payload, QUESTION)


@handoff_case("a sealed payload received twice (replay)", PayloadError, "replayed payload")
def _(s):
    keyed = ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=KEY)
    sealed = keyed.to_wire(keyed.send("Mary went to the kitchen."))
    keyed.receive(sealed, QUESTION, max_new_tokens=1)  # the first delivery is accepted
    return lambda: keyed.receive(sealed, QUESTION)


@handoff_case("a sealed payload older than max_age", PayloadError, "old", "max_age of 60 s")
def _(s):
    keyed = ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=KEY, max_age=60)
    stale = seal(s.wire, KEY, created_at=time.time() - 3600)
    return lambda: keyed.receive(stale, QUESTION)


@handoff_case("a sealed payload of envelope version 1 (no nonce)", PayloadError, "no nonce", "version 2")
def _(s):
    import hmac as hmac_

    body = SEAL_MAGIC + bytes([1]) + s.wire
    old = body + hmac_.new(KEY, body, hashlib.sha256).digest()
    keyed = ILCPHandoff.from_pretrained(s.run, lm=s.lm, auth_key=KEY)
    return lambda: keyed.receive(old, QUESTION)


@handoff_case("from_pretrained with export_key on an unsigned export", ExportError, "config.json",
              "no signature")
def _(s):
    return lambda: ILCPHandoff.from_pretrained(s.run, lm=s.lm, export_key=KEY)


@handoff_case("signed export, weights edited and their digest recomputed", ExportError, "config.json",
              "signature does not verify")
def _(s):
    run = sign_export(copy_run(s), KEY)
    edit_weights(run, lambda state: state["projector.trunk.0.bias"].add_(0.5))
    return lambda: ILCPHandoff.from_pretrained(run, lm=s.lm, export_key=KEY)


@handoff_case("export whose model.safetensors gains a tensor 'evil'", ExportError, "model.safetensors", "'evil'")
def _(s):
    run = copy_run(s)
    edit_weights(run, lambda state: state.update(evil=torch.zeros(3)))
    return lambda: ILCPHandoff.from_pretrained(run, lm=s.lm)


@handoff_case("export whose VAE input width does not fit its pooler", ExportError, "config.json",
              "do not fit together")
def _(s):
    run = copy_run(s)
    edit_config(run, lambda c: c["compressor"].update(input_dim=2 * c["compressor"]["input_dim"]))
    return lambda: ILCPHandoff.from_pretrained(run, lm=s.lm)


@pytest.mark.parametrize("case", list(HANDOFF))
def test_handoff_refuses(case, handoff, wire, tiny_run, tiny_lm, tmp_path):
    prepare, (error, *words) = HANDOFF[case]
    s = SimpleNamespace(tmp=tmp_path, run=tiny_run.run_dir, lm=tiny_lm, h=handoff, wire=wire)
    call = prepare(s)
    before = listing(tmp_path, tiny_run.run_dir)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert listing(tmp_path, tiny_run.run_dir) == before


# ------------------------------------------------------------------------------------ ilcp.rclc

RCLC: dict = {}
rclc_case = partial(register, RCLC)
STORY = [{"role": "user", "content": "Cedar is owned by Alice. Birch was launched in 1994."}]
REQUEST = "Who owns Cedar?"


@pytest.fixture(scope="module")
def other_lm():
    model, tokenizer = build_tiny_qwen3(seed=1)  # the same architecture and tokenizer, other weights
    return model.eval(), tokenizer


def transfer(s, **options):
    return lambda: rclc.transfer_sync(s.sender, s.inbox.append, REQUEST, **options)


def saved_snapshot(s, change=None) -> Path:
    """A snapshot of an agent on the same model, optionally damaged by `change(bytes) -> bytes`."""
    path = s.tmp / "agent.safetensors"
    asyncio.run(rclc.bind(s.model, s.tok, prompt="Birch was launched in 1994.").save(path))
    if change is not None:
        path.write_bytes(change(path.read_bytes()))
    return path


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


@rclc_case("bind messages that are a string", TypeError, "list of dicts", "got str")
def _(s):
    return lambda: rclc.bind(s.model, s.tok, messages="Cedar is owned by Alice.")


@rclc_case("bind a message without a role", ValueError, "'role'", "{'content': 'hi'}")
def _(s):
    return lambda: rclc.bind(s.model, s.tok, messages=[{"content": "hi"}])


@rclc_case("bind a message whose content is a number", TypeError, "content", "'content': 5")
def _(s):
    return lambda: rclc.bind(s.model, s.tok, messages=[{"role": "user", "content": 5}])


@rclc_case("bind an unknown backend", ValueError, "'tgi'")
def _(s):
    return lambda: rclc.bind(s.model, s.tok, messages=STORY, backend="tgi")


@rclc_case("bind max_new_tokens 0", ValueError, "max_new_tokens")
def _(s):
    return lambda: rclc.bind(s.model, s.tok, messages=STORY, max_new_tokens=0)


@rclc_case("bind a context_limit beyond the model", ValueError, "context_limit=1000000")
def _(s):
    return lambda: rclc.bind(s.model, s.tok, messages=STORY, context_limit=10**6)


@rclc_case("ratio given as a budget string", TypeError, "ratio", "'r4'")
def _(s):
    return transfer(s, ratio="r4")


@rclc_case("budget given as a string", TypeError, "budget", "'16'")
def _(s):
    return transfer(s, budget="16")


@rclc_case("budget 0", ValueError, "budget", "0")
def _(s):
    return transfer(s, budget=0)


@rclc_case("ratio and budget both", ValueError, "not both")
def _(s):
    return transfer(s, ratio=4, budget=8)


@rclc_case("selector given by name", TypeError, "'cacheback'", "rclc.selectors.cacheback")
def _(s):
    return transfer(s, selector="cacheback")


@rclc_case("unknown representation", ValueError, "'text'")
def _(s):
    return transfer(s, representation="text")


@rclc_case("empty request", ValueError, "request", "empty")
def _(s):
    return lambda: rclc.transfer_sync(s.sender, s.inbox.append, "")


@rclc_case("transfer to an agent with other weights", ValueError, "different weights")
def _(s):
    model, tokenizer = s.other
    receiver = rclc.bind(model, tokenizer, messages=[{"role": "system", "content": "Answer."}])
    s.receivers.append(receiver)
    return lambda: rclc.transfer_sync(s.sender, receiver, REQUEST)


@rclc_case("load a truncated snapshot", SnapshotError, "agent.safetensors", "truncated")
def _(s):
    path = saved_snapshot(s, lambda data: data[:-10])
    return lambda: asyncio.run(s.agent.load(path))


@rclc_case("load a snapshot with one bit flipped", SnapshotError, "agent.safetensors", "corrupted")
def _(s):
    path = saved_snapshot(s, lambda data: flip(data, len(data) - 3))
    return lambda: asyncio.run(s.agent.load(path))


@rclc_case("load a pickle", SnapshotError, "agent.pt")
def _(s):
    torch.save({"input_embeds": torch.zeros(2, 64)}, s.tmp / "agent.pt")
    return lambda: asyncio.run(s.agent.load(s.tmp / "agent.pt"))


@rclc_case("load a snapshot of another model", SnapshotError, "agent.safetensors", "another model")
def _(s):
    path = saved_snapshot(s)
    model, tokenizer = s.other
    agent = rclc.bind(model, tokenizer, prompt="Cedar is owned by Alice.")
    kept = agent.sender_state()
    s.after.append(lambda: agent.sender_state() is kept)
    return lambda: asyncio.run(agent.load(path))


@rclc_case("load a missing file", SnapshotError, "missing.safetensors")
def _(s):
    return lambda: asyncio.run(s.agent.load(s.tmp / "missing.safetensors"))


@rclc_case("save a snapshot onto a folder", IsADirectoryError, "snapshots", "is a folder")
def _(s):
    (s.tmp / "snapshots").mkdir()
    return lambda: asyncio.run(s.agent.save(s.tmp / "snapshots"))


def forged_snapshot(s, change) -> Path:
    """A snapshot saved with KEY, edited by `change(tensors, metadata)`, its digest recomputed and
    its old signature kept: what an attacker without the key can write."""
    path = s.tmp / "agent.safetensors"
    asyncio.run(rclc.bind(s.model, s.tok, prompt="Birch was launched in 1994.").save(path, key=KEY))
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    change(tensors, metadata)
    metadata["digest"] = content_digest(metadata, tensors["input_embeds"], tensors["token_ids"])
    save_file(tensors, str(path), metadata=metadata)
    return path


@rclc_case("load with a key a snapshot whose row was edited and digest recomputed", SnapshotError,
           "agent.safetensors", "signature does not verify")
def _(s):
    path = forged_snapshot(s, lambda tensors, metadata: tensors["input_embeds"][1].add_(1e-5))
    return lambda: asyncio.run(s.agent.load(path, key=KEY))


@rclc_case("load with a key a snapshot whose counts were edited and digest recomputed", SnapshotError,
           "signature does not verify")
def _(s):
    path = forged_snapshot(s, lambda tensors, metadata: metadata.update(
        inherited_positions=str(int(metadata["inherited_positions"]) + 1)))
    return lambda: asyncio.run(s.agent.load(path, key=KEY))


@rclc_case("load with a key a snapshot saved without one", SnapshotError, "no signature")
def _(s):
    path = saved_snapshot(s)
    return lambda: asyncio.run(s.agent.load(path, key=KEY))


@rclc_case("load a snapshot whose metadata says 0 positions", SnapshotError, "at least one position",
           "says 0")
def _(s):
    path = s.tmp / "empty.safetensors"
    write_snapshot(path, torch.zeros(0, s.model.config.hidden_size), torch.zeros(0, dtype=torch.long),
                   inherited_positions=0, latent_steps=0, fingerprint="0123456789abcdef")
    return lambda: asyncio.run(s.agent.load(path))


@pytest.mark.parametrize("case", list(RCLC))
def test_rclc_refuses(case, tiny_lm, other_lm, tmp_path):
    prepare, (error, *words) = RCLC[case]
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    agent = rclc.bind(model, tok, prompt="Cedar is owned by Alice.")
    kept = agent.sender_state()
    s = SimpleNamespace(tmp=tmp_path, model=model, tok=tok, other=other_lm, agent=agent, inbox=[], receivers=[],
                        sender=rclc.bind(model, tok, messages=STORY), after=[])
    call = prepare(s)
    before = listing(tmp_path)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert listing(tmp_path) == before
    # nothing delivered, no state replaced
    assert s.inbox == [] and all(len(r) == 0 for r in s.receivers)
    assert agent.sender_state() is kept and all(check() for check in s.after)


# ------------------------------------------------------------------- what the refusals rely on


def test_a_payload_is_checked_against_the_questions_before_anything_is_read_or_projected(handoff, monkeypatch):
    """100,000 latents for one question: refused from the header, before the tensor is read or the
    projector runs."""
    huge = pack(torch.zeros(100_000, handoff.latent_dim), lm_fingerprint=handoff.fingerprint).to_bytes()
    projected = []
    monkeypatch.setattr(handoff.encoder, "memory", lambda *a, **k: projected.append(1))
    monkeypatch.setattr("ilcp.wire.payload._read_array", lambda *a, **k: pytest.fail("the tensor was read"))
    with pytest.raises(PayloadError, match="100000 latent"):
        handoff.receive(huge, QUESTION)
    assert projected == []


def test_a_replay_is_refused_and_a_fresh_seal_of_the_same_payload_is_accepted(tiny_run, tiny_lm):
    sender = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    receiver = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    payload = sender.send("Mary went to the kitchen.")
    first, second = sender.to_wire(payload), sender.to_wire(payload)
    assert first != second  # a fresh nonce and time on every seal
    receiver.receive(first, QUESTION, max_new_tokens=1)
    with pytest.raises(PayloadError, match="replayed"):
        receiver.receive(first, QUESTION, max_new_tokens=1)
    receiver.receive(second, QUESTION, max_new_tokens=1)
    other = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    other.receive(first, QUESTION, max_new_tokens=1)  # each receiver remembers its own nonces only


def test_a_forged_digest_loads_without_a_key_and_is_refused_with_one(tiny_run, tmp_path):
    """Without a key the digest protects against accidents only: an edit with its digest
    recomputed loads (documented); the signature under a key refuses it."""
    run = sign_export(Path(shutil.copytree(tiny_run.run_dir, tmp_path / "run")), KEY)
    read_export(run, key=KEY)
    edit_weights(run, lambda state: state["projector.trunk.0.bias"].add_(0.5))
    read_export(run)
    with pytest.raises(ExportError, match="signature does not verify"):
        read_export(run, key=KEY)
    with pytest.raises(ExportError, match="signature does not verify"):
        read_export(sign_export(tmp_path / "run", b"j" * 32), key=KEY)  # signed under another key


def test_an_overlong_question_is_refused_before_it_is_tokenised(handoff, wire, monkeypatch):
    calls = []
    tokenizer = handoff.lm.tokenizer
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: calls.append(1))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="characters"):
        handoff.receive(wire, "x" * 10_000_000)
    with pytest.raises(ValueError, match="characters"):
        handoff.send("x" * 10_000_000)
    assert calls == [] and time.perf_counter() - start < 1.0

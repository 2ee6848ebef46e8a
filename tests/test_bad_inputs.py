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
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from ilcp import cli, rclc
from ilcp.export import ExportError
from ilcp.handoff import ILCPHandoff
from ilcp.lm import build_tiny_qwen3
from ilcp.rclc import SnapshotError
from ilcp.transport import PayloadError, pack

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


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
    (run / "config.json").write_text(json.dumps(config))


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


@train_case("unknown task", "data.task", "squad")
def _(s):
    return ["--config", str(TINY), *runs(s), "data.task=squad"]


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


@train_case("python -m ilcp with an unknown command", "'fit'", "{train,eval}")
def _(s):
    s.main = cli.main
    return ["fit", "--config", str(TINY)]


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


@eval_case("unknown task", "'squad'")
def _(s):
    return ["--ckpt", str(s.run), "--tasks", "squad"]


@eval_case("bAbI task not shipped", "babi:99")
def _(s):
    return ["--ckpt", str(s.run), "--tasks", "babi:99"]


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

"""Command lines answer --help and refuse bad arguments before torch, Lightning, transformers or
datasets are imported; a mistyped config key, section or method names the closest valid one; the
light name lists of `ilcp.names` equal the ones the heavy modules use."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ilcp import cli, names
from ilcp.config import load_config

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "lightning", "transformers", "datasets")

# Runs each command line in one fresh interpreter, then reports the exit codes and which heavy
# packages were imported.
PROBE = """
import json, sys
from ilcp import cli

calls = {
    "train --help": (cli.train_main, ["--help"]),
    "train bad key": (cli.train_main, ["handoff.max_stpes=3"]),
    "train bad value": (cli.train_main, ["handoff.max_steps=abc"]),
    "train bad section": (cli.train_main, ["handof.max_steps=3"]),
    "train missing config": (cli.train_main, ["--config", sys.argv[1] + "/missing.yaml"]),
    "eval --help": (cli.eval_main, ["--help"]),
    "eval bad flag": (cli.eval_main, ["--ckpt", sys.argv[1], "--bogus"]),
    "eval bad number": (cli.eval_main, ["--ckpt", sys.argv[1], "--limit", "abc"]),
    "eval unknown method": (cli.eval_main, ["--ckpt", sys.argv[1], "--methods", "cold_reed"]),
    "eval missing ckpt": (cli.eval_main, ["--ckpt", sys.argv[1] + "/missing"]),
    "python -m ilcp --help": (cli.main, ["--help"]),
    "python -m ilcp fit": (cli.main, ["fit"]),
}
codes = {}
for what, (main, argv) in calls.items():
    try:
        codes[what] = main(argv)
    except SystemExit as e:
        codes[what] = e.code
heavy = [m for m in sys.argv[2:] if m in sys.modules]
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def run_python(args, cwd=REPO):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_command_lines_check_arguments_without_heavy_imports(tmp_path):
    done = run_python(["-c", PROBE, str(tmp_path), *HEAVY])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    codes = report["codes"]
    assert codes.pop("train --help") == codes.pop("eval --help") == codes.pop("python -m ilcp --help") == 0
    assert set(codes.values()) == {2}, codes
    assert "did you mean handoff.max_steps?" in done.stderr
    assert "did you mean 'cold_read'?" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("entry", [["train.py"], ["eval.py"], ["-m", "ilcp"], ["-m", "ilcp", "eval"]])
def test_help_of_each_entry_point_imports_no_heavy_package(entry):
    done = run_python(["-X", "importtime", *entry, "--help"])
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "ilcp" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("overrides, message", [
    (["handoff.max_stpes=3"], "unknown config field handoff.max_stpes; did you mean handoff.max_steps?"),
    (["handof.max_steps=3"], "unknown config section handof; did you mean handoff?"),
    (["max_steps=3"], "unknown config field max_steps; did you mean handoff.max_steps?"),
    (["epochs=3"], "unknown config field epochs; did you mean compressor.epochs?"),
    (["handoff.max_stpes=3", "handoff.zzzz=1"],
     "unknown config fields handoff.max_stpes (did you mean handoff.max_steps?), handoff.zzzz; known: "
     "handoff.variants, "),
    (["handoff.zzzz=1"], "unknown config field handoff.zzzz; known: handoff.variants, handoff.num_memory_tokens, "),
])
def test_unknown_config_key_names_the_closest_one(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_unknown_config_key_in_a_file_names_the_closest_one(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("compressor:\n  latent_dimm: 8\n")
    with pytest.raises(ValueError, match=r"compressor\.latent_dimm; did you mean compressor\.latent_dim\?"):
        load_config(config)


@pytest.mark.parametrize("name, message", [
    ("cold_reed", "unknown method 'cold_reed'; did you mean 'cold_read'?"),
    ("rclc-quik", "unknown method 'rclc-quik'; did you mean 'rclc-quick'?"),
    ("rcl:cacheback:r4", "unknown method 'rcl:cacheback:r4'; did you mean 'rclc:cacheback:r4'?"),
    ("telepathy", "unknown method 'telepathy'; known: cold_read, cold_read_tuned, ilcp, no_context, prompt_tuned, "
                  "kv_relay:..., rclc:...; groups: default, rclc, "),
])
def test_unknown_method_names_the_closest_one(name, message, tmp_path, capsys):
    assert names.unknown_method(name).startswith(message)
    with pytest.raises(SystemExit) as info:
        cli.eval_main(["--ckpt", str(tmp_path), "--methods", f"ilcp,{name}"])
    assert info.value.code == 2
    assert f"ilcp-eval: error: {message}" in capsys.readouterr().err


def test_what_the_light_method_check_lets_through_the_registry_makes():
    from ilcp import evaluation

    members = [m for group in evaluation.method_groups().values() for m in group]
    accepted = [*names.METHODS, *names.METHOD_GROUPS, *members, "rclc:cacheback:r4:tuned", "kv_relay:qsnap:b16"]
    assert [m for m in accepted if names.unknown_method(m) is not None] == []
    for name in members:  # what the light check lets through, the registry makes
        evaluation.make_method(name)


def test_light_constants_equal_the_modules_that_use_them():
    from ilcp import lm
    from ilcp.encoder import model as encoder
    from ilcp.wire import payload as transport
    from ilcp.evaluation import decoders

    assert (encoder.VOCABULARY_SNAPS, encoder.SNAP_METRICS) == (names.VOCABULARY_SNAPS, names.SNAP_METRICS)
    assert lm.DEFAULT_LM == names.DEFAULT_LM
    assert transport.DTYPES == names.PAYLOAD_DTYPES
    assert decoders.ENGINES == names.ENGINES


def test_every_task_name_pattern_has_its_source_registered():
    """`ilcp.names.TASK_NAMES` (what configs check without importing datasets) and the registry's
    sources (`ilcp.tasks`) are the same list; each pattern resolves to its own source."""
    from ilcp.tasks import resolve_task
    from ilcp.tasks.registry import task_sources

    assert task_sources() == tuple(names.TASK_NAMES)
    examples = {"babi": "babi:all", "facts": "facts", "babilong": "babilong:1:0.5k", "squad": "squad",
                "files": "jsonl:notes.jsonl", "mix": "mix:squad|babi:1"}
    assert set(examples) == set(names.TASK_NAMES)
    for source, name in examples.items():
        assert names.task_source(name) == source
        assert resolve_task(name).name == name
    assert names.unknown_task("trivia").startswith("unknown task 'trivia'")

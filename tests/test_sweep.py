"""ilcp_experiments.sweep (the payload sweep; `python -m ilcp_experiments sweep` is its command line): the tiny sweep
end to end (train, evaluate, plot, table), reuse of finished runs and evaluations, refusal of a
changed run, and the checks on sweep files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ilcp.cli import build_eval_parser
from ilcp.config import load_config
from ilcp_experiments import sweep as payload_sweep
from ilcp_experiments.sweep import render, schema

REPO = Path(__file__).resolve().parent.parent
SWEEPS = REPO / "configs" / "sweep"


def _args(root: Path, sweep: Path = SWEEPS / "tiny.yaml", *extra: str) -> list[str]:
    return ["--sweep", str(sweep), "--out", str(root / "out"), "--checkpoints", str(root / "runs"),
            "--set", f"lm.cache_dir={root / 'cache'}", *extra]


def _run_files(runs: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(runs.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory, tiny_lm):
    root = tmp_path_factory.mktemp("sweep")
    lines: list[str] = []
    assert payload_sweep.main(_args(root), lm=tiny_lm, log=lines.append) == 0
    return root, lines


def _rows(summary: dict, panel: str) -> dict[str, dict]:
    return {r["label"]: r for r in summary["rows"] if r["panel"] == panel}


def test_tiny_sweep_writes_every_point_the_plot_and_the_table(tiny_sweep):
    root, lines = tiny_sweep
    out = root / "out"
    summary = json.loads((out / "sweep.json").read_text())
    declared = [p["name"] for p in yaml.safe_load((SWEEPS / "tiny.yaml").read_text())["points"]]
    assert [p["name"] for p in summary["points"]] == declared
    assert all(p["training"] == "trained" and p["evaluation"] == "evaluated" for p in summary["points"])
    assert summary["reference"]["variants"] == ["prompt_tuned", "cold_read_tuned"]
    panels = [p["key"] for p in summary["panels"]]
    assert panels == ["facts", "facts-heldout", "facts-heldout@1", "facts-heldout@4", "facts-heldout@8"]
    points = {p["name"]: p for p in summary["points"]}
    for panel in panels:
        rows = _rows(summary, panel)
        for name in declared:
            assert rows[name]["kind"] == "ilcp" and rows[name]["wire_bytes"] > 0 and rows[name]["n"] == 4
            assert 0.0 <= rows[name]["exact_match"] <= 1.0 and len(rows[name]["exact_match_ci"]) == 2
        # one latent per context: the bytes grow with the latent's width, whatever the context
        single = sorted((p for p in points.values() if not p["chunk_tokens"] and p["payload_dtype"] == "float32"),
                        key=lambda p: p["latent_dim"])
        assert len(single) == 3
        wire = [rows[p["name"]]["wire_bytes"] for p in single]
        assert wire == sorted(set(wire)), wire
        assert [rows[p["name"]]["tensor_bytes"] for p in single] == [4 * p["latent_dim"] for p in single]
        # the same run's latents sent as int8 take fewer bytes
        assert rows["chunk4-8-int8"]["wire_bytes"] < rows["chunk4-8"]["wire_bytes"]
        assert rows["prompt_tuned"]["wire_bytes"] == 0
        assert rows["cold_read_tuned"]["wire_bytes"] > 0
    # chunked payloads grow with the context; single ones do not
    one, eight = _rows(summary, "facts-heldout@1"), _rows(summary, "facts-heldout@8")
    assert eight["chunk4-8"]["wire_bytes"] > one["chunk4-8"]["wire_bytes"]
    assert eight["single-8"]["wire_bytes"] == one["single-8"]["wire_bytes"]
    # the bytes the sweep computes for the facts-count panels match evaluate()'s own on the same questions
    four, heldout = _rows(summary, "facts-heldout@4"), _rows(summary, "facts-heldout")
    for label in declared + ["cold_read_tuned"]:
        assert four[label]["wire_bytes"] == pytest.approx(heldout[label]["wire_bytes"]), label
    # rows that only the task panels carry
    assert {"cold_read", "rclc:cacheback:r4"} <= set(_rows(summary, "facts")) and "cold_read" not in one
    assert (out / "accuracy_vs_wire_bytes.png").stat().st_size > 10_000
    md = (out / "sweep.md").read_text()
    assert all(f"| {name} |" in md for name in declared) and "## facts-heldout, 8 facts per context" in md
    for label in ["reference", "selection"] + declared:
        assert (out / "evals" / label / "results.json").is_file()
    assert any("run single-4: training" in line for line in lines)


def test_the_selection_rows_are_read_on_the_reference_run_and_tabled_per_selector(tiny_sweep):
    root, _ = tiny_sweep
    summary = json.loads((root / "out" / "sweep.json").read_text())
    declared = yaml.safe_load((SWEEPS / "tiny.yaml").read_text())["selection"]["methods"]
    assert summary["selection"]["methods"] == declared and summary["selection"]["run"] == "reference"
    selection = [r for r in summary["rows"] if r["kind"] == "selection"]
    # tasks: [] reads the training task only, at the selection's own limit
    assert {r["panel"] for r in selection} == {"facts"} and {r["n"] for r in selection} == {3}
    assert sorted(r["label"] for r in selection) == sorted(declared)
    rows = {r["label"]: r for r in selection}
    assert rows["rclc:cacheback:r1"]["wire_bytes"] > rows["rclc:cacheback:r2"]["wire_bytes"] > \
        rows["rclc:cacheback:r4"]["wire_bytes"] > 0
    # the same selection, with or without the tuned vectors in front, sends the same rows
    assert rows["rclc:cacheback:r1"]["wire_bytes"] == rows["rclc:cacheback:r1:tuned"]["wire_bytes"]
    md = (root / "out" / "sweep.md").read_text()
    assert "Selection rows: 8 rclc/kv_relay rows on run `reference`, 3 questions per task" in md
    facts_section = md.split("## facts\n")[1].split("\n## ")[0]
    assert "| selector | r4 | r2 | b4 | r1 | r4 / r1 | r16 / r1 |" in facts_section
    assert "| rclc:cacheback |" in facts_section and "| rclc:qsnap:tuned |" in facts_section
    assert "rclc:qsnap:r4:tuned" not in facts_section.split("Selection rows")[0]  # not among the reference rows


def test_the_selection_table_divides_by_the_r1_row_of_the_same_option():
    def row(label, em, wire):
        return {"label": label, "exact_match": em, "exact_match_ci": [em, em], "wire_bytes": wire, "n": 10}

    lines = render.selection_table([
        row("rclc:cacheback:r1", 0.4, 100), row("rclc:cacheback:r4", 0.1, 25), row("rclc:cacheback:r16", 0.0, 7),
        row("rclc:cacheback:b16", 0.2, 50), row("rclc:qsnap:r4", 0.3, 25), row("rclc:qsnap:r16", 0.2, 7),
        row("rclc:cacheback:r1:tuned", 0.5, 100), row("rclc:qsnap:r4:tuned", 0.5, 25),
    ])
    table = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| rclc")}
    assert lines[3] == "| selector | r16 | r4 | b16 | r1 | r4 / r1 | r16 / r1 |"
    assert table["rclc:cacheback"] == "| rclc:cacheback | 0.0 | 10.0 | 20.0 | 40.0 | 25% | 0% |"
    assert table["rclc:qsnap"] == "| rclc:qsnap | 20.0 | 30.0 | - | 40.0 | 75% | 50% |"
    assert table["rclc:qsnap:tuned"] == "| rclc:qsnap:tuned | - | 50.0 | - | 50.0 | 100% | - |"
    assert render.selection_table([row("rclc:qsnap:r4", 0.3, 25)]) == []  # no curve of two budgets


def test_a_second_run_reuses_the_trained_runs(tiny_sweep, tiny_lm):
    root, _ = tiny_sweep
    before = _run_files(root / "runs")
    assert before
    lines: list[str] = []
    assert payload_sweep.main(_args(root), lm=tiny_lm, log=lines.append) == 0
    assert _run_files(root / "runs") == before
    for run in ("reference", "single-4", "single-8", "single-16", "chunk4-8", "chunk4-8-recon"):
        assert any(line.startswith(f"run {run}: reusing the finished run") for line in lines), run
    assert not any(": training" in line or ": resuming" in line for line in lines)
    summary = json.loads((root / "out" / "sweep.json").read_text())
    assert {p["training"] for p in summary["points"]} == {"reused"}
    assert {p["evaluation"] for p in summary["points"]} == {"evaluated"}
    # --resume also keeps the evaluations, so no LM is needed at all
    lines = []
    assert payload_sweep.main(_args(root, SWEEPS / "tiny.yaml", "--resume"), log=lines.append) == 0
    assert not any("loading LM" in line for line in lines)
    assert sum("reusing" in line and line.startswith("eval ") for line in lines) == 8
    resumed = json.loads((root / "out" / "sweep.json").read_text())
    assert {p["evaluation"] for p in resumed["points"]} == {"reused"}
    assert resumed["rows"] == summary["rows"]
    assert _run_files(root / "runs") == before


def _one_point_sweep(path: Path, latent_dim: int) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "one", "base": str(REPO / "configs" / "tiny.yaml"),
        "overrides": ["handoff.max_steps=2", "handoff.val_every_steps=2"],
        "eval": {"limit": 2, "facts_counts": [], "max_new_tokens": 2},
        "points": [{"name": "p", "overrides": [f"compressor.latent_dim={latent_dim}"]}],
    }))
    return path


def test_a_run_folder_holding_another_config_is_refused_unless_overwrite(tmp_path, tiny_lm, capsys):
    quiet = [].append
    assert payload_sweep.main(_args(tmp_path, _one_point_sweep(tmp_path / "a.yaml", 4)), lm=tiny_lm, log=quiet) == 0
    run = tmp_path / "runs" / "p"
    before = _run_files(run)
    changed = _one_point_sweep(tmp_path / "b.yaml", 6)
    assert payload_sweep.main(_args(tmp_path, changed), lm=tiny_lm, log=quiet) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "compressor.latent_dim: 4 there, 6 here" in err
    assert _run_files(run) == before
    assert payload_sweep.main(_args(tmp_path, changed, "--overwrite"), lm=tiny_lm, log=quiet) == 0
    assert json.loads((run / "config.json").read_text())["latent_dim"] == 6
    summary = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert summary["points"][0]["training"] == "retrained" and summary["reference"] is None
    assert [p["key"] for p in summary["panels"]] == ["babi:1"]


def test_an_unfinished_run_needs_resume_or_overwrite(tmp_path, tiny_lm, capsys):
    sweep = _one_point_sweep(tmp_path / "a.yaml", 4)
    quiet = [].append
    assert payload_sweep.main(_args(tmp_path, sweep), lm=tiny_lm, log=quiet) == 0
    (tmp_path / "runs" / "p" / "config.json").unlink()  # as if training had stopped before the export
    assert payload_sweep.main(_args(tmp_path, sweep), lm=tiny_lm, log=quiet) == 2
    assert "unfinished" in capsys.readouterr().err
    lines: list[str] = []
    assert payload_sweep.main(_args(tmp_path, sweep, "--resume"), lm=tiny_lm, log=lines.append) == 0
    assert any(line.startswith("run p: resuming") for line in lines)
    assert (tmp_path / "runs" / "p" / "config.json").is_file()


@pytest.mark.parametrize("name", ["facts.yaml", "babi1.yaml", "tiny.yaml"])
def test_shipped_sweeps_resolve(name, tmp_path):
    sweep = payload_sweep.load_sweep(SWEEPS / name, checkpoints=tmp_path)
    for p in sweep.points:
        assert sweep.configs[p.run].handoff.variants == ["ilcp"]
        assert sweep.configs[p.run].run_dir == tmp_path / p.run
    assert sweep.configs[sweep.reference.run].handoff.variants == ["prompt_tuned", "cold_read_tuned"]
    assert {"cold_read", "cold_read_tuned", "prompt_tuned"} <= set(sweep.reference.methods)
    assert any(p.payload_dtype == "int8" for p in sweep.points)
    configs = [sweep.configs[p.run] for p in sweep.points]
    assert any(c.compressor.memory.chunk_tokens > 0 for c in configs)
    assert len({(c.compressor.latent_dim, c.compressor.memory.chunk_tokens) for c in configs}) >= 2


def test_the_facts_sweep_has_the_promised_points():
    sweep = payload_sweep.load_sweep(SWEEPS / "facts.yaml")
    cfg = {p.name: sweep.configs[p.run] for p in sweep.points}
    dtype = {p.name: p.payload_dtype for p in sweep.points}
    assert all(c.data.task == "facts" and c.data.facts_value_split == "train" for c in sweep.configs.values())
    spec = cfg["spec-32"]
    assert (spec.compressor.memory.kind, spec.compressor.latent_dim, spec.compressor.memory.chunk_tokens) == ("mean", 32, 0)
    assert not spec.handoff.finetune_encoder and spec.compressor.answer_head_weight == 0
    chunked = cfg["chunk12-64"].compressor
    assert (chunked.memory.chunk_tokens, chunked.latent_dim) == (12, 64)
    assert cfg["chunk12-64-int8"] is cfg["chunk12-64"] and dtype["chunk12-64-int8"] == "int8"
    codec = cfg["codec4-128"]  # the token codec of configs/facts-codec.yaml, on the sweep's 4-fact task
    own = load_config(REPO / "configs" / "facts-codec.yaml")
    for section in ("compressor", "reconstruct"):
        for key in ("latent_dim", "chunk_tokens", "pooling", "token_steps", "steps", "token_weight", "random_texts",
                    "token_logits", "token_shape_weight"):
            if hasattr(getattr(own, section), key):
                assert getattr(getattr(codec, section), key) == getattr(getattr(own, section), key), (section, key)
    assert codec.data.pool_layers == own.data.pool_layers == [0]
    assert (codec.handoff.memory_placement, codec.handoff.num_memory_tokens) == ("in_prompt", 4)
    for key in ("vocabulary_snap", "snap_metric", "snap_temperature", "validate_start", "max_steps", "lr"):
        assert getattr(codec.handoff, key) == getattr(own.handoff, key), key
    assert codec.handoff.vocabulary_snap == "hard" and codec.handoff.validate_start
    narrow = cfg["codec4-64"]  # the earlier codec: half the floats, cosine logits and snap
    assert (narrow.compressor.latent_dim, narrow.reconstruct.token_logits, narrow.handoff.snap_metric) == (
        64, "cosine", "cosine")
    # the reference run trains first; the codecs read its cold_read_tuned vectors
    for point in (codec, narrow):
        assert Path(point.handoff.format_from) == sweep.checkpoints / sweep.reference.run
    assert cfg["codec4-64-int8"] is narrow and dtype["codec4-64-int8"] == "int8"
    assert cfg["codec4-128-int8"] is codec and dtype["codec4-128-int8"] == "int8"
    assert sweep.eval.tasks == ("facts-heldout",) and sweep.eval.facts_counts == (1, 8)
    assert sweep.out == Path("results/sweep-facts") and sweep.checkpoints == Path("checkpoints/sweep-facts")
    limited = payload_sweep.load_sweep(SWEEPS / "facts.yaml", limit=20)
    assert (limited.eval.limit, limited.eval.facts_count_limit) == (20, 20)


BASE = {"name": "bad", "base": str(REPO / "configs" / "tiny.yaml"),
        "points": [{"name": "a", "overrides": ["compressor.latent_dim=4"]}]}


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, "unknown key"),
    ({"base": None}, "base"),
    ({"base": "configs/nope.yaml"}, "not found"),
    ({"points": []}, "non-empty list"),
    ({"points": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"points": [{"name": "a b"}]}, "plain name"),
    ({"points": [{"name": "a", "payload_dtype": "int4"}]}, "payload_dtype"),
    ({"points": [{"name": "a", "overrides": ["handoff.variants=[ilcp]"]}]}, "set by the sweep"),
    ({"points": [{"name": "a", "overrides": ["run_name=x"]}]}, "set by the sweep"),
    ({"points": [{"name": "a", "overrides": ["latent_dim"]}]}, "key=value"),
    ({"points": [{"name": "a", "overrides": ["compressor.latent_dim=0"]}]}, "compressor.latent_dim must be >= 1"),
    ({"points": [{"name": "a", "overrides": ["compressor.memory.chunk_tokens=4"]}]}, "answer_head_weight=0"),
    ({"points": [{"name": "a", "overrides": ["compressor.nope=1"]}]}, "unknown config field"),
    ({"points": [{"name": "a", "overrides": ["compressor.latent_dim=4"]},
                 {"name": "b", "run": "a", "overrides": ["compressor.latent_dim=8"], "payload_dtype": "int8"}]},
     "share run 'a'"),
    ({"points": [{"name": "a"}, {"name": "b", "run": "a"}]}, "same payload dtype"),
    ({"points": [{"name": "a", "speed": 1}]}, "unknown key"),
    ({"reference": {"methods": ["ilcp"]}}, "points are the ilcp rows"),
    ({"reference": {"methods": ["telepathy"]}}, "unknown method"),
    ({"reference": {"methods": []}}, "non-empty list"),
    ({"reference": {"methods": ["prompt_tuned"], "run": "a"}}, "also a point's run"),
    ({"reference": {"methods": ["cold_read"], "overrides": ["handoff.max_steps=2"]}}, "no reference run"),
    ({"reference": {"methods": ["cold_read"]}, "points": [{"name": "reference"}]}, "rename the point"),
    ({"selection": {"methods": ["rclc:qsnap:r4"]}}, "add a reference section"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": ["cold_read"]}}, "only rclc"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": []}}, "non-empty list"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": ["rclc:nope:r4"]}}, "unknown selector"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": ["rclc:qsnap:r4"], "tasks": ["babi:2"]}},
     "drawn from eval.tasks"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": ["rclc:qsnap:r4"], "tasks": [2]}},
     "drawn from eval.tasks"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": ["rclc:qsnap:r4"], "limit": -2}},
     "selection.limit"),
    ({"reference": {"methods": ["cold_read"]}, "selection": {"methods": ["rclc:qsnap:r4"], "colour": 1}},
     "unknown selection key"),
    ({"reference": {"methods": ["cold_read"]}, "points": [{"name": "selection"}]}, "rename the point"),
    ({"eval": {"tasks": ["babi:999"]}}, "eval.tasks"),
    ({"eval": {"limit": -1}}, "eval.limit"),
    ({"eval": {"facts_counts": [0]}}, "eval.facts_counts"),
    ({"eval": {"shots": 3}}, "unknown eval key"),
    ({"overrides": {"out_dir": "x"}}, "set by the sweep"),
])
def test_bad_sweep_files_are_value_errors_naming_the_problem(tmp_path, change, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASE, **change}))
    with pytest.raises(ValueError, match=message):
        payload_sweep.load_sweep(path)


def test_override_forms_and_a_reference_without_weights(tmp_path):
    path = tmp_path / "forms.yaml"
    path.write_text(yaml.safe_dump({
        **BASE, "overrides": "compressor.beta=0.2 handoff.max_steps=3",
        "reference": {"methods": ["cold_read", "no_context"]},
        "points": [{"name": "a", "overrides": {"compressor.latent_dim": 12, "compressor.memory.kind": "mean",
                                               "handoff.finetune_encoder": False}}],
    }))
    sweep = payload_sweep.load_sweep(path, extra=["handoff.batch_size=2"])
    cfg = sweep.configs["a"]
    assert (cfg.compressor.beta, cfg.handoff.max_steps, cfg.handoff.batch_size) == (0.2, 3, 2)
    assert (cfg.compressor.latent_dim, cfg.compressor.memory.kind, cfg.handoff.finetune_encoder) == (12, "mean", False)
    assert sweep.reference.run is None and list(sweep.configs) == ["a"]
    assert schema.eval_entries(sweep)[0].run == "a"


def test_selection_rows_needing_weights_train_them_on_the_reference_run(tmp_path):
    path = tmp_path / "selection.yaml"
    path.write_text(yaml.safe_dump({
        **BASE, "eval": {"tasks": ["babi:2"], "limit": 50},
        "reference": {"methods": ["cold_read"]},
        "selection": {"methods": ["rclc:qsnap:r4:tuned", "rclc:qsnap:r1:tuned", "rclc:qsnap:r4"]},
    }))
    sweep = payload_sweep.load_sweep(path)
    assert sweep.reference.run == "reference" and list(sweep.configs["reference"].handoff.variants) == [
        "cold_read_tuned"]
    entry = schema.eval_entries(sweep)[-1]
    assert (entry.label, entry.kind, entry.run) == ("selection", "selection", "reference")
    settings = schema.entry_settings(sweep, entry)
    assert (settings.tasks, settings.limit, settings.facts_counts) == (("babi:2",), 50, ())
    assert payload_sweep.load_sweep(path, limit=5).selection.limit == 5  # --limit sets it too
    raw = yaml.safe_load(path.read_text())
    raw["selection"].update(tasks=[], limit=0)
    path.write_text(yaml.safe_dump(raw))
    assert payload_sweep.load_sweep(path).selection == schema.Selection(
        methods=("rclc:qsnap:r4:tuned", "rclc:qsnap:r1:tuned", "rclc:qsnap:r4"), tasks=(), limit=None)


def test_the_command_line_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        payload_sweep.main(["--sweep", str(SWEEPS / "tiny.yaml"), "--limit", "0"])
    assert "--limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        payload_sweep.main(["--sweep", str(tmp_path / "missing.yaml")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        payload_sweep.main(["--sweep", str(SWEEPS / "tiny.yaml"), "--set", "nonsense"])
    assert "key=value" in capsys.readouterr().err


def test_the_command_line_runs_from_the_repository():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "ilcp_experiments", "sweep", "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--sweep SWEEP" in done.stdout and "The sweep file (YAML" in done.stdout
    unknown = subprocess.run([sys.executable, "-m", "ilcp_experiments", "sweeps"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unknown command 'sweeps'" in unknown.stderr


def test_eval_py_takes_the_payload_dtype():
    parser = build_eval_parser()  # eval.py's parser
    assert parser.parse_args(["--ckpt", "x"]).payload_dtype == "float32"
    assert parser.parse_args(["--ckpt", "x", "--payload-dtype", "int8"]).payload_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ckpt", "x", "--payload-dtype", "int4"])

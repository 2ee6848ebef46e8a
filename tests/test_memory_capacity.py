"""benchmarks/memory_capacity.py on the tiny LM: vectors optimized against the frozen receiver read
back better than random ones of the same norm, and the command writes its JSON, README and plot,
with an encoder's figures beside the ceiling's."""

import json

import pytest
import torch

from tests._benchmarks import load_benchmark
from tests.conftest import raw_weight_digest

mc = load_benchmark("memory_capacity")


def test_the_ceiling_beats_a_random_memory_of_the_same_norm(tiny_lm):
    tok = tiny_lm.tokenizer
    text = tok("Mary moved to the hallway. John went to the garden.", add_special_tokens=False)["input_ids"][:8]
    instruction = mc.instruction_ids(tok)
    before = raw_weight_digest(tiny_lm.model)
    random_memory = mc.random_memory(tiny_lm, 1, 2)
    optimized = mc.optimized_memory(tiny_lm, [text], 2, instruction, steps=40, lr=3e-2)
    assert raw_weight_digest(tiny_lm.model) == before  # only the vectors moved
    assert torch.allclose(random_memory[0].norm(dim=-1), torch.full((2,), mc.embedding_norm(tiny_lm)))
    random_figures = mc.read_back(tiny_lm, list(random_memory), [text], instruction)[0]
    ceiling = mc.read_back(tiny_lm, list(optimized), [text], instruction)[0]
    assert ceiling["loss"] < random_figures["loss"]
    assert 0 <= ceiling["prefix"] <= len(text) and ceiling["exact"] == (ceiling["prefix"] == len(text))


def test_the_greedy_prefix_counts_tokens_before_the_first_mismatch():
    assert mc.greedy_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert mc.greedy_prefix([1, 2], [1, 2, 3]) == 2
    assert mc.greedy_prefix([5], [1]) == 0


def test_texts_are_cut_to_their_first_l_tokens_and_shorter_ones_left_out(tiny_lm):
    texts = mc.held_out_texts(tiny_lm.tokenizer, [8, 100_000], 2)
    assert [t["source"] for t in texts[8]] == ["squad", "squad", "background", "background", "babi", "babi"]
    assert all(len(t["ids"]) == 8 for t in texts[8]) and texts[100_000] == []
    assert mc.held_out_texts(tiny_lm.tokenizer, [8], 2)[8] == texts[8]  # seeded
    assert mc.held_out_texts(tiny_lm.tokenizer, [8], 2, sources=["babi"])[8] == texts[8][4:]


def test_a_babi_source_can_be_one_task_s_test_stories(tiny_lm):
    from ilcp.tasks import babi_stories

    assert mc.source_name("babi:01") == "babi:1" and mc.source_name("squad") == "squad"
    texts = mc.held_out_texts(tiny_lm.tokenizer, [8], 3, sources=["babi:16", "babi:1"])[8]
    assert [t["source"] for t in texts] == ["babi:16"] * 3 + ["babi:1"] * 3
    stories = {n: babi_stories(n, split="test") for n in (1, 16)}
    for t in texts:
        story = stories[int(t["source"].split(":")[1])][t["index"]]
        assert tiny_lm.tokenizer(story, add_special_tokens=False)["input_ids"][:8] == t["ids"]
    # sources in a fixed order: the named ones, then bAbI tasks by number
    assert sorted(["babi:16", "babi:2", "squad", "babi"], key=lambda s: mc.row_order(s, 8, "x", 1)) == \
        ["squad", "babi", "babi:2", "babi:16"]


def test_the_command_writes_its_json_readme_and_plot_with_an_encoder(tmp_path, tiny_lm, tiny_run, capsys):
    out = tmp_path / "memory-capacity"
    code = mc.main(["--lm", "tiny-qwen3", "--lengths", "8", "--ks", "1", "2", "--texts", "2", "--steps", "10",
                    "--encoder", str(tiny_run.run_dir), "--out", str(out)], lm=tiny_lm)
    assert code == 0
    data = json.loads((out / mc.JSON_NAME).read_text())
    assert (out / mc.PLOT_NAME).stat().st_size > 0
    table = (out / mc.TABLE_NAME).read_text()
    assert "| source | L | memory | K | tokens per vector |" in table and "| squad | 8 | ceiling | 2 | 4 | 2 |" in table
    readme = (out / "README.md").read_text()
    assert "## How it was made" in readme and mc.PLOT_NAME in readme
    assert data["lm"] == "tiny-qwen3" and data["settings"]["steps"] == 10
    assert data["provenance"]["date"] and data["provenance"]["machine"] and data["provenance"]["command"]
    assert data["provenance"]["command"].startswith("python ") and "--ks 1 2 --texts 2" in data["provenance"]["command"]
    name = tiny_run.run_dir.name
    assert [(c["memory"], c["k"]) for c in data["cells"]][:2] == [("ceiling", 1), ("ceiling", 2)]
    encoder = [c for c in data["cells"] if c["memory"] == name]
    assert len(encoder) == 1 and len(encoder[0]["texts"]) == 6
    for text in encoder[0]["texts"]:
        assert {"token_accuracy", "loss", "exact", "prefix", "ce_without_memory", "vectors"} <= set(text)
        assert text["vectors"] >= 1
    assert data["encoders"][0]["name"] == name
    rows = {(r["source"], r["memory"], r["K"]) for r in data["summary"]}
    assert ("squad", "ceiling", 2) in rows and ("babi", name, encoder[0]["k"]) in rows
    log = capsys.readouterr().out
    assert "L=8 ceiling K=1" in log and f"L=8 {name} K=" in log and "| source | L |" in log


@pytest.mark.parametrize("argv, message", [
    (["--ks", "0"], "expected a positive integer"),
    (["--lengths", "x"], "expected an integer, got 'x'"),
    (["--lr", "0"], "expected a positive number"),
    (["--sources", "wiki"], "unknown source 'wiki'; known: squad, background, babi, or babi:N for N in 1,"),
    (["--sources", "babi:99"], "unknown source 'babi:99'"),
    (["--steps", "-1"], "--steps must be 0 or more"),
    (["--encoder", "/nonexistent/run"], "no config.json there"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        mc.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_the_script_runs_as_its_readme_command_from_the_checkout(tmp_path):
    """`python benchmarks/memory_capacity.py ...` as a command (the repository root is not on the
    path then): it writes its README through ilcp_experiments all the same."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "capacity"
    done = subprocess.run([sys.executable, "benchmarks/memory_capacity.py", "--lm", "tiny-qwen3", "--lengths", "8",
                           "--ks", "1", "--texts", "1", "--sources", "squad", "--steps", "2", "--threads", "1",
                           "--out", str(out)], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ILCP_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "README.md").is_file() and (out / "memory_capacity.json").is_file()


def test_an_encoder_read_through_each_payload_dtype(tmp_path, tiny_lm, tiny_run):
    """Each payload dtype's bytes cross the wire: float16 reads back the float32 figures within its
    rounding, int8 is named apart, and the memory itself is what the bytes carry."""
    out = tmp_path / "dtypes"
    assert mc.main(["--lm", "tiny-qwen3", "--lengths", "8", "--texts", "2", "--no-ceiling", "--encoder",
                    str(tiny_run.run_dir), "--payload-dtypes", "float32", "float16", "int8", "--out", str(out)],
                   lm=tiny_lm) == 0
    data = json.loads((out / mc.JSON_NAME).read_text())
    name = tiny_run.run_dir.name
    assert [c["memory"] for c in data["cells"]] == [name, f"{name} (float16)", f"{name} (int8)"]
    assert [e["payload_dtype"] for e in data["encoders"]] == ["float32", "float16", "int8"]
    full, half, quantised = data["cells"]
    for a, b in zip(full["texts"], half["texts"]):
        assert abs(a["loss"] - b["loss"]) < 1e-2
    from ilcp.handoff import ILCPHandoff

    handoff = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    text = "Mary went to the kitchen."
    exact, rounded = (mc.encoder_memory(handoff, text, d) for d in ("float32", "int8"))
    assert torch.equal(exact, mc.encoder_memory(handoff, text)) and not torch.equal(exact, rounded)
    assert torch.allclose(exact, rounded, atol=0.1 * float(exact.abs().max()))


def test_the_ceiling_is_reused_from_an_earlier_run_only_where_it_was_computed_alike(tmp_path, tiny_lm, tiny_run):
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    common = ["--lm", "tiny-qwen3", "--lengths", "8", "--ks", "1", "2", "--texts", "1", "--steps", "5"]
    assert mc.main([*common, "--out", str(first)], lm=tiny_lm) == 0
    earlier = json.loads((first / mc.JSON_NAME).read_text())
    assert mc.main([*common, "--encoder", str(tiny_run.run_dir), "--ceiling-from", str(first / mc.JSON_NAME),
                    "--out", str(second)], lm=tiny_lm) == 0
    again = json.loads((second / mc.JSON_NAME).read_text())
    reused = [c for c in again["cells"] if c["memory"] == "ceiling"]
    assert [c["reused_from"] for c in reused] == [str(first / mc.JSON_NAME)] * 2
    assert [c["texts"] for c in reused] == [c["texts"] for c in earlier["cells"]]
    assert any(c["memory"] == tiny_run.run_dir.name for c in again["cells"])
    other = [*common[:-1], "6", "--ceiling-from", str(first / mc.JSON_NAME), "--out", str(third)]
    assert mc.main(other, lm=tiny_lm) == 0  # other steps: computed again
    assert all("reused_from" not in c for c in json.loads((third / mc.JSON_NAME).read_text())["cells"])

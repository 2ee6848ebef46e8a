"""Training on several devices: ``train.py trainer.devices=2 trainer.strategy=ddp`` on the CPU (two
processes, gloo) trains the tiny run end to end, writes every file once from rank 0, and gives
what one device gives; settings two devices cannot run are refused before anything starts."""

import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.encoder.model import ConstantMemory
from ilcp.export import read_export
from ilcp.handoff import ILCPHandoff
from ilcp.training import train
from ilcp.training.data import GlobalBatchShards

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """(run directory, stderr) of the tiny run trained by two CPU processes, with a cache of its own."""
    out = tmp_path_factory.mktemp("ddp-run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ILCP_CACHE": str(out / "cache")}
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(TINY), f"out_dir={out}",
           f"lm.cache_dir={out / 'cache'}", "trainer.devices=2", "trainer.strategy=ddp"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "tiny", proc.stderr


def test_two_processes_write_one_complete_loadable_run(two_process_run, tiny_lm):
    run_dir, stderr = two_process_run
    out = run_dir.parent
    assert not list(out.rglob("*.tmp")), "a half-written file is left"
    run = read_export(run_dir)  # checks every file against the digests in config.json
    assert set(run.soft_prompts) == {"prompt_tuned", "cold_read_tuned"}
    handoff = ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm)
    assert isinstance(handoff.receive(handoff.to_wire(handoff.send("John went to the garden.")), "Where is John?",
                                      max_new_tokens=2), str)
    # rank 0 alone extracted the sender states (one cache file per split) and reported progress
    assert len(list((out / "cache" / "pooled").glob("*.safetensors"))) == 2
    assert stderr.count("[ilcp] exported to") == 1
    assert stderr.count("computed in") == 2 and "read from cache" not in stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for variant in ("ilcp", "prompt_tuned", "cold_read_tuned"):
        assert metrics["variants"][variant]["steps"] == 4
        assert [r["step"] for r in metrics["variants"][variant]["curve"]] == [2, 4]
        # each validation logged once: one CSV row per step and metric, not one per rank
        with open(run_dir / "logs" / variant / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("val/loss")]
        assert sorted(Counter(r["step"] for r in rows).values()) == [1, 1]


def test_two_processes_train_what_one_device_trains(two_process_run, tiny_run, tiny_lm):
    """The same global batches: both keep the same step, and the soft prompts match one device's
    to within what float order moves four AdamW steps (a near-zero gradient's sign can flip, and
    AdamW's normalised step is then lr either way: measured 1.8e-4 at most, 2e-5 on average, where
    the prompts moved more than 1e-3 from their start). The decoded questions' answer
    cross-entropy, which breaks a tie in exact match, is the same on both (each row counted once);
    the validation loss differs only in how the batch means are averaged (measured: 3e-3) and
    stage 1 only in its VAE noise (measured: val/loss 5e-3)."""
    run_dir, _ = two_process_run
    one, two = tiny_run.result.metrics, json.loads((run_dir / "metrics.json").read_text())
    for name in ("prompt_tuned", "cold_read_tuned"):
        start = ConstantMemory.from_embedding_rows(tiny_lm.model, 2, reads_context_text=False).soft_prompt.detach()
        ref = load_file(str(tiny_run.run_dir / f"{name}.safetensors"))["soft_prompt"]
        got = load_file(str(run_dir / f"{name}.safetensors"))["soft_prompt"]
        assert (ref - start).abs().max() > 1e-3
        assert two["variants"][name]["best_step"] == one["variants"][name]["best_step"]
        torch.testing.assert_close(got, ref, atol=5e-4, rtol=0)
        assert float((got - ref).abs().mean()) < 1e-4
        for a, b in zip(one["variants"][name]["curve"], two["variants"][name]["curve"]):
            assert b["val/answer_ce"] == pytest.approx(a["val/answer_ce"], abs=1e-4)
    for variant in ("ilcp", "prompt_tuned", "cold_read_tuned"):
        assert two["variants"][variant]["final_val_loss"] == pytest.approx(one["variants"][variant]["final_val_loss"],
                                                                           abs=0.01)
        assert two["variants"][variant]["best_val_exact_match"] == one["variants"][variant]["best_val_exact_match"]
    assert two["compressor"]["val/loss"] == pytest.approx(one["compressor"]["val/loss"], abs=0.05)
    assert two["compressor"]["val/active_units"] == one["compressor"]["val/active_units"]


@pytest.mark.parametrize("n, batch", [(32, 4), (10, 4), (5, 4)])
def test_ranks_together_take_the_one_device_batches(n, batch):
    one = [b.tolist() for b in torch.utils.data.DataLoader(range(n), batch_size=batch, shuffle=True,
                                                           generator=torch.Generator().manual_seed(3))]
    shares = [list(GlobalBatchShards(n, batch, shuffle=True, seed=3, ranks=2, rank=r)) for r in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == len(one)
    for step, rows in enumerate(one):
        together = shares[0][step] + shares[1][step]
        assert set(together) == set(rows)
        assert shares[0][step] and shares[1][step]  # no rank takes an empty batch
        assert len(together) == max(len(rows), 2)


def test_settings_two_devices_cannot_run_are_refused_before_anything_starts(tmp_path):
    base = [f"out_dir={tmp_path}", "trainer.devices=2", "trainer.strategy=ddp"]
    with pytest.raises(ValueError, match="handoff.batch_size=3 is the global batch"):
        train(load_config(TINY, base + ["handoff.batch_size=3"]))
    assert not (tmp_path / "tiny").exists()
    with pytest.raises(ValueError, match="ddp_spawn"):
        load_config(TINY, base + ["trainer.strategy=ddp_spawn"])


_READ_BY_TWO_RANKS = """
import json, sys
from pathlib import Path
from ilcp.cli import setup_logging
from ilcp.config import load_config
from ilcp.lm import load_lm
from ilcp.training.data import prepare_data
from ilcp.training.distributed import Processes, rank

setup_logging()
out = Path(sys.argv[1])
cfg = load_config(sys.argv[2], [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "trainer.devices=2",
                                "trainer.strategy=ddp"])
procs = Processes(cfg.trainer)
procs.launch()
lm = load_lm(cfg.lm.spec)
with procs.main_first():  # as a run does: rank 0 extracts, then the other rank reads the cache
    train_rows, _ = prepare_data(cfg, lm)
flat = train_rows.states.flat
mapped = []  # the file mapping that holds the states' first byte
for line in Path("/proc/self/maps").read_text().splitlines():
    parts = line.split()
    if len(parts) >= 6 and parts[5].endswith(".safetensors"):
        low, high = (int(x, 16) for x in parts[0].split("-"))
        if low <= flat.data_ptr() < high:
            mapped.append([parts[5], parts[4]])
found = {"rank": rank(), "mapped": mapped, "sum": float(train_rows.states.mean().sum())}
(out / f"rank{rank()}.json").write_text(json.dumps(found))
procs.finish()
"""


def test_two_ranks_read_the_one_memory_mapped_cache(tmp_path):
    """Both ranks of a two-process run read the training states through a memory map of the same
    cache file (one inode, in the page cache once), not a copy each."""
    script = tmp_path / "read_by_two_ranks.py"
    script.write_text(_READ_BY_TWO_RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ILCP_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(TINY)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(len(r["mapped"]) == 1 for r in ranks), ranks
    assert ranks[0]["mapped"] == ranks[1]["mapped"], "each rank maps the same file (path and inode)"
    assert ranks[0]["sum"] == ranks[1]["sum"]
    assert len(list((tmp_path / "cache" / "pooled").glob("*.safetensors"))) == 2  # extracted once, by rank 0
    assert proc.stderr.count("computed in") == 2 and "refused" not in proc.stderr

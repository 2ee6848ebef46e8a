"""Long contexts reach the sender whole: training extraction, `ILCPHandoff.send` and
`send_from_hidden_states` read up to the LM's own limit (data.max_length=0), in batches bounded
by padded positions; a run configured to truncate records it, and the sender warns when it cuts."""

import json
from pathlib import Path

import pytest
import torch

from ilcp.config import load_config
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.pooling import length_batches, sender_token_states
from ilcp.training import extraction, train
from ilcp.training.extraction import token_states
from ilcp.wire.payload import TransportPayload

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
SENTENCE = "The ship sailed north along the coast while the crew mended the nets. "


def _context(lm, tokens: int) -> str:
    """Real-looking text of at least `tokens` tokens of `lm`."""
    text = SENTENCE
    while len(lm.tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
        text += SENTENCE
    return text.strip()


def test_length_batches_bound_rows_and_padded_positions():
    assert length_batches([3, 4, 5, 6], batch_size=2) == [[0, 1], [2, 3]]
    assert length_batches([10, 20, 30, 5000, 9000], batch_size=4, max_tokens=100) == [[0, 1, 2], [3], [4]]
    assert length_batches([40, 50, 60], batch_size=8, max_tokens=100) == [[0, 1], [2]]  # 2 x 50 fits, 3 x 60 not
    assert length_batches([], batch_size=4) == []


def test_extraction_reads_long_contexts_whole_and_one_at_a_time(tiny_lm, monkeypatch):
    long_text, short = _context(tiny_lm, 1500), "A short context."
    widths = []
    real = extraction.sender_token_states

    def recording(model, input_ids, attention_mask, layers=(-1,)):
        widths.append(tuple(input_ids.shape))
        return real(model, input_ids, attention_mask, layers)

    monkeypatch.setattr(extraction, "sender_token_states", recording)
    states = token_states(tiny_lm, [long_text, short, long_text], max_length=4096, max_batch_tokens=2000,
                          progress=False)
    n_long = len(tiny_lm.tokenizer(long_text, add_special_tokens=False)["input_ids"])
    assert n_long >= 1500
    assert states.offsets.diff().tolist()[0] == n_long  # the whole context, not its last 512 tokens
    assert all(rows * width <= 2000 or rows == 1 for rows, width in widths)
    assert sorted(widths)[-1][0] == 1  # the long contexts went one at a time


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("long-run")
    cfg = load_config(TINY, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "compressor.memory.chunk_tokens=256",
                             "compressor.answer_head_weight=0", "handoff.variants=[ilcp]"])
    assert cfg.data.max_length == 0  # the default: the LM's own limit
    return train(cfg, lm=tiny_lm)


def test_the_export_records_the_lm_s_limit_and_send_reads_the_whole_context(long_run, tiny_lm):
    config = json.loads((long_run.run_dir / "config.json").read_text())
    assert config["pooling"]["max_length"] == tiny_lm.max_positions
    handoff = ILCPHandoff.from_pretrained(long_run.run_dir, lm=tiny_lm)
    text = _context(tiny_lm, 1300)
    n = len(tiny_lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    payload = handoff.send(text)
    assert tuple(payload.latent.shape) == (-(-n // 256), handoff.latent_dim)  # one latent per chunk of the whole context

    # the same latents from the sender's own forward over every token
    ids = tiny_lm.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = tiny_lm.model(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    reused = handoff.send_from_hidden_states(out, torch.ones_like(ids))
    torch.testing.assert_close(reused.latent[0], payload.latent, rtol=1e-4, atol=1e-5)
    direct = sender_token_states(tiny_lm.model, ids, torch.ones_like(ids))
    assert direct.shape[1] == n


def test_chunk_latents_of_a_long_context_round_trip_the_wire_format(long_run, tiny_lm):
    handoff = ILCPHandoff.from_pretrained(long_run.run_dir, lm=tiny_lm)
    payload = handoff.send(_context(tiny_lm, 1100))
    wire = payload.to_bytes()
    back = TransportPayload.from_bytes(wire, expected_fingerprint=tiny_lm.fingerprint)
    assert torch.equal(back.latent, payload.latent)
    memory = handoff.memory_vectors(wire)
    assert memory.shape == (1, payload.latent.shape[0] * handoff.num_memory_tokens, tiny_lm.hidden_size)
    assert isinstance(handoff.receive(wire, "Where did the ship sail?"), str)


def test_a_run_configured_to_truncate_says_so(tmp_path, tiny_lm, caplog):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "data.max_length=16",
                             "handoff.variants=[ilcp]"])
    with caplog.at_level("INFO", logger="ilcp.training"):
        result = train(cfg, lm=tiny_lm)
    assert json.loads((result.run_dir / "config.json").read_text())["pooling"]["max_length"] == 16
    assert any("longer than data.max_length=16" in r.getMessage() for r in caplog.records)
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    with pytest.warns(UserWarning, match="longer than this export's max_length of 16 tokens") as said:
        handoff.send(_context(tiny_lm, 40))
    assert said[0].filename == __file__  # the warning points at the caller's line
    with pytest.raises(ValueError, match="data.max_length must be >= 0"):
        load_config(TINY, ["data.max_length=-1"])


def test_eval_reports_the_contexts_the_ilcp_sender_cut(tmp_path, tiny_lm):
    from ilcp.evaluation.run import evaluate

    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "data.max_length=24",
                             "handoff.variants=[ilcp]"])
    run_dir = train(cfg, lm=tiny_lm).run_dir
    res = evaluate(run_dir, methods=["ilcp"], limit=6, latency_n=0, lengths=[], lm=tiny_lm, out=tmp_path / "eval")
    task = res["tasks"]["babi:1"]
    assert task["ilcp_max_length"] == 24 and 0 < task["ilcp_truncated"] <= 6
    assert task["context_tokens"]["max"] > 24
    assert "longer than the ilcp export's max_length of 24 tokens" in (tmp_path / "eval" / "results.md").read_text()


def test_eval_at_several_lengths_tables_and_plots_accuracy_and_receiver_cost(tiny_run, tiny_lm, tmp_path):
    from ilcp.evaluation.report import PLOT_LENGTH, PLOT_LENGTH_TTFT
    from ilcp.evaluation.run import evaluate

    res = evaluate(tiny_run.run_dir, tasks=["babilong:1:0", "babilong:1:0.5k", "babilong:1:1k"],
                   methods=["no_context", "cold_read", "ilcp"], limit=3, latency_n=2, lengths=[], lm=tiny_lm,
                   out=tmp_path / "eval")
    tokens = [res["tasks"][t]["context_tokens"]["mean"] for t in ("babilong:1:0", "babilong:1:0.5k", "babilong:1:1k")]
    assert tokens[0] < tokens[1] < tokens[2] <= 1024
    cold = [res["tasks"][t]["methods"]["cold_read"]["prefill_positions"] for t in ("babilong:1:0.5k", "babilong:1:1k")]
    ilcp = [res["tasks"][t]["methods"]["ilcp"]["prefill_positions"] for t in ("babilong:1:0.5k", "babilong:1:1k")]
    assert cold[1] > cold[0] + 300 and ilcp[0] == ilcp[1]  # the text grows with the context, the memory does not
    report = (tmp_path / "eval" / "results.md").read_text()
    assert "## Exact match against context length (BABILong)" in report
    assert report.count("| 1 | cold_read |") == 3
    assert {PLOT_LENGTH, PLOT_LENGTH_TTFT} <= set(res["plots"])
    reused = res["tasks"]["babilong:1:1k"]["methods"]["ilcp"]["latency"]["sender_reusing_forward_s"]
    full = res["tasks"]["babilong:1:1k"]["methods"]["ilcp"]["latency"]["sender_s"]
    assert reused["n"] == 2 and 0 < reused["p50"] < full["p50"]  # no forward to run
    assert all((tmp_path / "eval" / name).stat().st_size > 0 for name in res["plots"])

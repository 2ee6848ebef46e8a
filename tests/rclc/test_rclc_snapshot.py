"""Agent snapshots: what is written, atomic replacement, and every refusal on load (another model,
truncated or corrupted files, pickles, pending inputs, queued handoffs) with the state intact."""

import asyncio
import json
import struct

import pytest
import torch
from safetensors import safe_open

from ilcp import io as ilcp_io
from ilcp import rclc
from ilcp.lm import lm_fingerprint
from ilcp.rclc import backends, snapshot


@pytest.fixture
def continued(model, tokenizer, history_x, history_y):
    """An agent holding received rows and a generated continuation, plus its sender agent."""
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    rclc.transfer_sync(x, y, "Who owns Cedar?")
    inputs = y.pop()
    y.update(inputs=inputs, generation=model.generate(**inputs, do_sample=False, return_dict_in_generate=True))
    return x, y


def test_round_trip_writes_rows_ids_counts_and_fingerprint(model, tokenizer, continued, tmp_path):
    _, y = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(y.save(path))
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["input_embeds", "token_ids"]  # no weights, caches or history
        meta = f.metadata()
    assert meta["fingerprint"] == lm_fingerprint(model, tokenizer)
    assert meta["format"] == snapshot.FORMAT and int(meta["inherited_positions"]) > 0
    assert [p.name for p in tmp_path.iterdir()] == ["agent.safetensors"]  # no temporary files left

    restored = rclc.bind(model, tokenizer, max_new_tokens=8)
    asyncio.run(restored.load(path))
    a, b = y.sender_state(), restored.sender_state()
    assert torch.equal(a.input_embeds, b.input_embeds) and torch.equal(a.token_ids, b.token_ids)
    assert (a.inherited_positions, a.latent_steps) == (b.inherited_positions, b.latent_steps)
    assert int((b.token_ids == -1).sum()) == a.inherited_positions  # received rows stay unknown


def test_history_state_and_latent_counts_round_trip(model, tokenizer, history_x, sender, tmp_path):
    agent = rclc.bind(model, tokenizer, messages=history_x)
    asyncio.run(agent.save(tmp_path / "history.safetensors"))
    assert agent._history is None  # saving runs no prefill
    restored = rclc.bind(model, tokenizer)
    asyncio.run(restored.load(tmp_path / "history.safetensors"))
    assert restored.sender_state().positions == rclc.sender_from_hf(model, tokenizer, history_x).positions

    latent = rclc.latent_mass_sync(sender, steps=3)
    holder = rclc.bind(model, tokenizer)
    holder._explicit = latent.replace(inherited_positions=2)
    asyncio.run(holder.save(tmp_path / "latent.safetensors"))
    asyncio.run(restored.load(tmp_path / "latent.safetensors"))
    state = restored.sender_state()
    assert (state.latent_steps, state.inherited_positions) == (3, 2)
    assert torch.equal(state.input_embeds, latent.input_embeds)


def test_another_model_is_refused(continued, other_lm, tmp_path):
    _, y = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(y.save(path))
    other_model, other_tokenizer = other_lm
    agent = rclc.bind(other_model, other_tokenizer, prompt="Cedar is owned by Alice.")
    kept = agent._explicit
    with pytest.raises(rclc.SnapshotError, match="another model"):
        asyncio.run(agent.load(path))
    assert agent._explicit is kept


def test_truncated_corrupted_and_foreign_files_are_refused(model, tokenizer, continued, tmp_path):
    _, y = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(y.save(path))
    data = path.read_bytes()
    agent = rclc.bind(model, tokenizer, prompt="Cedar is owned by Alice.")
    kept = agent.sender_state()

    def refused(content: bytes, match: str):
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(content)
        with pytest.raises(rclc.SnapshotError, match=match):
            asyncio.run(agent.load(bad))
        assert agent.sender_state() is kept

    refused(data[: len(data) - 10], "truncated")
    refused(data[:20], "truncated|corrupted")
    refused(b"", "shorter than")
    refused(struct.pack("<Q", 4) + b"{{{{" + b"\0" * 8, "corrupted")
    torch.save({"input_embeds": torch.zeros(2, 2)}, tmp_path / "pickle.pt")
    refused((tmp_path / "pickle.pt").read_bytes(), "truncated|corrupted|not a snapshot")
    with pytest.raises(rclc.SnapshotError, match="cannot read"):
        asyncio.run(agent.load(tmp_path / "missing.safetensors"))

    rows, ids = torch.zeros(3, 64), torch.tensor([1, 2, 3])
    meta = {"format": snapshot.FORMAT, "version": snapshot.VERSION, "fingerprint": lm_fingerprint(model, tokenizer),
            "dtype": "float32", "hidden_size": "64", "positions": "3", "inherited_positions": "0", "latent_steps": "0"}

    def written(tensors, metadata, match):
        """A file whose digest matches its (inconsistent) content: the structural checks must catch it."""
        bad = tmp_path / "written.safetensors"
        if "input_embeds" in tensors and "token_ids" in tensors:
            metadata = {**metadata, "digest": snapshot.content_digest(metadata, tensors["input_embeds"],
                                                                      tensors["token_ids"])}
        ilcp_io.atomic_save_safetensors(tensors, bad, metadata=metadata)
        refused(bad.read_bytes(), match)

    written({"input_embeds": rows, "token_ids": ids}, {**meta, "version": "9"}, "version")
    written({"input_embeds": rows, "token_ids": ids}, {**meta, "format": "other"}, "not an agent snapshot")
    written({"input_embeds": rows, "token_ids": ids, "weights": rows}, meta, "exactly")
    written({"input_embeds": rows, "token_ids": ids}, {**meta, "positions": "4"}, "metadata says")
    written({"input_embeds": rows, "token_ids": ids}, {**meta, "latent_steps": "2"}, "latent tail")
    written({"input_embeds": rows.double(), "token_ids": ids}, {**meta, "dtype": "float64"}, "dtype")
    written({"input_embeds": rows, "token_ids": ids}, meta, "do not match the embeddings")
    written({"input_embeds": rows.fill_(float("nan")), "token_ids": ids}, meta, "non-finite")


def test_save_and_load_refuse_pending_and_queued(model, tokenizer, continued, tmp_path):
    x, y = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(y.save(path))
    rclc.transfer_sync(x, y, "Who owns Cedar?")
    with pytest.raises(RuntimeError, match="queued"):
        asyncio.run(y.save(tmp_path / "queued.safetensors"))
    with pytest.raises(RuntimeError, match="queued"):
        asyncio.run(y.load(path))
    y.pop()
    with pytest.raises(RuntimeError, match="pending"):
        asyncio.run(y.save(tmp_path / "pending.safetensors"))
    with pytest.raises(RuntimeError, match="pending"):
        asyncio.run(y.load(path))
    assert not (tmp_path / "queued.safetensors").exists() and not (tmp_path / "pending.safetensors").exists()
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(rclc.bind(model, prompt=torch.tensor([[1, 2]])).save(tmp_path / "t.safetensors"))


def test_save_replaces_atomically(continued, tmp_path, monkeypatch):
    _, y = continued
    path = tmp_path / "agent.safetensors"
    path.write_bytes(b"previous")

    def failing(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(ilcp_io, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        asyncio.run(y.save(path))
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["agent.safetensors"]
    monkeypatch.undo()
    asyncio.run(y.save(path))
    assert snapshot.read_snapshot(path).positions == y.sender_state().positions


def test_cancelled_load_keeps_the_state_and_cancelled_save_completes(model, tokenizer, continued, tmp_path, monkeypatch):
    _, y = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(y.save(path))
    agent = rclc.bind(model, tokenizer, prompt="Cedar is owned by Alice.")
    kept = agent._explicit
    real = backends.HFBackend.rows_state

    def slow(self, *args):
        import time

        time.sleep(0.3)
        return real(self, *args)

    monkeypatch.setattr(backends.HFBackend, "rows_state", slow)

    async def cancel(coro):
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel(agent.load(path)))
    assert agent._explicit is kept and agent._busy is None

    real_write = snapshot.write_snapshot

    def slow_write(*args, **kwargs):
        import time

        time.sleep(0.3)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(snapshot, "write_snapshot", slow_write)
    target = tmp_path / "cancelled.safetensors"
    asyncio.run(cancel(y.save(target)))
    assert snapshot.read_snapshot(target).positions == y.sender_state().positions  # the write completed


def test_header_metadata_is_plain_json(continued, tmp_path):
    _, y = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(y.save(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + length])
    assert set(header["__metadata__"]) >= {"fingerprint", "inherited_positions", "latent_steps", "dtype"}


def test_a_flipped_bit_anywhere_in_a_snapshot_is_refused_with_the_state_intact(model, tokenizer, continued, tmp_path):
    import random

    _, agent = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(agent.save(path))
    data = path.read_bytes()
    kept = agent.sender_state()
    rng = random.Random(0)
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    for trial in range(300):
        # half the flips inside the tensor bytes (continuous rows included), half anywhere
        low = header_end if trial % 2 == 0 else 0
        i = rng.randrange(low, len(data))
        bad = bytearray(data)
        bad[i] ^= 1 << rng.randrange(8)
        (tmp_path / "bad.safetensors").write_bytes(bytes(bad))
        with pytest.raises(rclc.SnapshotError):
            asyncio.run(agent.load(tmp_path / "bad.safetensors"))
        assert agent.sender_state() is kept
    asyncio.run(agent.load(path))


def test_version_one_snapshots_without_a_digest_still_load(model, tokenizer, continued, tmp_path):
    from safetensors import safe_open

    _, agent = continued
    path = tmp_path / "agent.safetensors"
    asyncio.run(agent.save(path))
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.pop("digest")
    meta["version"] = "1"
    old = tmp_path / "v1.safetensors"
    ilcp_io.atomic_save_safetensors(tensors, old, metadata=meta)
    asyncio.run(agent.load(old))

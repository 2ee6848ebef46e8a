"""Receivers behind a real vLLM server (`ilcp.engines.served`): one ``python -m ilcp serve`` of the
tiny test LM on 127.0.0.1 for the module, always stopped; answers equal the in-process vLLM
receiver's (float32) for ILCP and RCLC rows, sealed payloads are opened by the receiver only, a
server of another model is refused, and a stopped or silent server is one clear error in time."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from test_parity import CONTEXTS, QUESTIONS, _random_prefixes

from ilcp import rclc
from ilcp.engines import served as served_module
from ilcp.engines.embedding_table import EmbeddingTable, load_embedding_lm, table_digest
from ilcp.engines.served import (
    ModelMismatchError,
    ServedDecoder,
    ServedReceiver,
    ServerError,
)
from ilcp.engines.vllm import VLLMDecoder, VLLMReceiver
from ilcp.handoff import ILCPHandoff
from ilcp.wire.payload import PayloadError

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
KEY = b"served-receiver-test-key-0123456"
HISTORY_X = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Mary moved to the hallway. John went to the garden. Sandra took the milk."},
    {"role": "assistant", "content": "Noted."},
]
HISTORY_Y = [{"role": "system", "content": "You answer briefly."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m ilcp serve RUN`` in its own process group; `stop` ends the group."""

    def __init__(self, run: Path, folder: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = folder / f"server-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "ilcp", "serve", str(run), "--port", str(self.port), "--",
                   "--enforce-eager", "--max-num-seqs", "4", "--max-model-len", "1024"]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"the server did not answer within {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)


@pytest.fixture(scope="module")
def local_engine(vllm_folder, tiny_lm_dir, tiny_vllm_lm, tiny_engine):
    """This module's own in-process engine (the reference answers): an engine the session's other
    modules created may have seen vLLM's process-wide parallel state torn down by then.

    It is made after the session's `tiny_engine`, which the RCLC test binds agents to: a second
    in-process engine on the same folder reports a tokenizer with one more token (vocab 506, not
    the checkpoint's 505), so an agent on it and one on the HF model fail the same-vocabulary
    check. Run with the whole of tests/vllm, an earlier module made `tiny_engine` first; run alone,
    this module did not, and the RCLC test failed. Requesting it here makes the order explicit."""
    from ilcp.engines.vllm import create_engine

    return create_engine(tiny_lm_dir, kv_cache_memory_bytes=64 << 20, max_model_len=1024)


@pytest.fixture(scope="module")
def server(tiny_vllm_run, vllm_folder):
    srv = Server(Path(tiny_vllm_run), vllm_folder)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def served_receiver(server, tiny_vllm_run):
    return ServedReceiver.from_pretrained(tiny_vllm_run, server.url, timeout=60)


def test_serve_prints_the_vllm_command_it_runs(server, tiny_vllm_run, tiny_vllm_lm):
    first = next(line for line in server.log.read_text().splitlines() if " -m vllm." in line)
    assert "vllm.entrypoints.openai.api_server" in first and "--enable-prompt-embeds" in first
    digest = table_digest(tiny_vllm_lm.model.get_input_embeddings().weight, tiny_vllm_lm.tokenizer)
    assert f"--served-model-name ilcp-{tiny_vllm_lm.fingerprint}-{digest}" in first
    assert "--dtype float32" in first and first.endswith("--max-model-len 1024")


def test_the_receivers_process_holds_only_the_embedding_table(served_receiver, tiny_vllm_lm):
    lm = served_receiver.handoff.lm
    assert isinstance(lm.model, EmbeddingTable)
    assert [n for n, _ in lm.model.named_parameters()] == ["embed_tokens.weight"]
    torch.testing.assert_close(lm.model.get_input_embeddings().weight,
                               tiny_vllm_lm.model.get_input_embeddings().weight, rtol=0, atol=0)
    assert lm.fingerprint == tiny_vllm_lm.fingerprint


def test_ilcp_answers_equal_the_in_process_receivers(served_receiver, tiny_handoff, local_engine):
    local = VLLMReceiver(tiny_handoff, local_engine)
    assert served_receiver.decoder.stops == local.stops
    payload = tiny_handoff.send(CONTEXTS)
    for stop_at_newline in (False, True):
        expected = local.receive(payload, QUESTIONS, 8, stop_at_newline=stop_at_newline)
        assert served_receiver.receive(payload.to_bytes(), QUESTIONS, 8, stop_at_newline=stop_at_newline) == expected
    one = tiny_handoff.send(CONTEXTS[0])
    requests = [(payload, QUESTIONS), (one.to_bytes(), QUESTIONS[0])]
    assert served_receiver.receive_many(requests, 6) == local.receive_many(requests, 6)
    prefixes = _random_prefixes(tiny_handoff.lm, QUESTIONS + QUESTIONS, seed=1)
    ids = local.decode_ids(prefixes, max_new_tokens=12)
    assert served_receiver.decoder.decode_ids(prefixes, max_new_tokens=12) == ids
    assert len({tuple(row) for row in ids}) > 1, "the prefixes should reach different answers"


def test_rclc_rows_answer_as_in_process(server, tiny_engine, tiny_vllm_lm, tiny_lm_dir):
    decoder = ServedDecoder.connect(server.url, tiny_lm_dir, timeout=60)
    local = VLLMDecoder(tiny_vllm_lm, tiny_engine)
    x = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_X, max_new_tokens=8, placement="in_prompt")
    y = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_Y, max_new_tokens=8, placement="in_prompt")
    hy = rclc.bind(tiny_vllm_lm.model, tiny_vllm_lm.tokenizer, messages=HISTORY_Y, max_new_tokens=8,
                   placement="in_prompt")
    requests = ["Where is Mary?", "Who took the milk?"]
    rclc.transfer_sync(x, [y, hy], requests, ratio=4)
    popped = [y.pop(discard_pending=True) for _ in requests]
    popped_hf = [hy.pop(discard_pending=True) for _ in requests]
    rows = [p["prompts"]["prompt_embeds"] for p in popped]
    for stop_at_newline in (False, True):
        expected = local.decode(rows, max_new_tokens=8, stop_at_newline=stop_at_newline)
        assert decoder.answer(popped, stop_at_newline=stop_at_newline) == expected
        assert decoder.answer(popped_hf, stop_at_newline=stop_at_newline) == expected
    assert decoder.answer(popped[0]) == local.decode(rows[:1], max_new_tokens=8)[0]


def _serving_snippet(name: str) -> str:
    """docs/serving.md's ```python block after ``<!-- snippet: NAME -->``."""
    text = (ROOT / "docs" / "serving.md").read_text()
    start = text.index("```python\n", text.index(f"<!-- snippet: {name} -->")) + len("```python\n")
    return text[start:text.index("```\n", start)]


def test_the_served_snippet_runs_against_the_server(server, tiny_vllm_run, tiny_handoff, local_engine, capsys):
    """docs/serving.md's served snippet, whole, with the test run and this server in place of its run
    folder and URL: it prints the ILCP answer and the RCLC answer the in-process engine gives."""
    code = _serving_snippet("served")
    assert code.count('"checkpoints/default"') == 1 and code.count('"http://127.0.0.1:8000/v1"') == 1
    code = code.replace('"checkpoints/default"', repr(str(tiny_vllm_run)))
    code = code.replace('"http://127.0.0.1:8000/v1"', repr(server.url))
    exec(compile(code, "docs/serving.md served snippet", "exec"), {"__name__": "serving_snippet"})
    printed = capsys.readouterr().out.splitlines()
    local = VLLMReceiver(tiny_handoff, local_engine)
    story = "Mary moved to the hallway. John went to the garden."
    assert len(printed) == 2
    assert printed[0] == local.receive(tiny_handoff.send(story), "Where is Mary?")
    lm = tiny_handoff.lm
    a = rclc.bind(lm.model, lm.tokenizer, messages=[{"role": "user", "content": story}], placement="in_prompt",
                  max_new_tokens=8)
    b = rclc.bind(lm.model, lm.tokenizer, messages=[], placement="in_prompt", max_new_tokens=8)
    rclc.transfer_sync(a, b, "Where is Mary?", ratio=4)
    rows = b.pop()["inputs_embeds"]
    assert printed[1] == VLLMDecoder(lm, local_engine).decode([rows[0]], max_new_tokens=8)[0]


def test_sealed_payloads_are_opened_by_the_receiver_only(server, tiny_vllm_run, tiny_vllm_lm, tiny_handoff,
                                                         local_engine, monkeypatch):
    sender = ILCPHandoff.from_pretrained(tiny_vllm_run, lm=tiny_vllm_lm, auth_key=KEY)
    receiver = ServedReceiver.from_pretrained(tiny_vllm_run, server.url, auth_key=KEY, timeout=60)
    payload = sender.send(CONTEXTS[1])
    wire = sender.to_wire(payload)
    expected = VLLMReceiver(tiny_handoff, local_engine).receive(payload, QUESTIONS[1])
    assert receiver.receive(wire, QUESTIONS[1]) == expected

    def no_request(*args, **kwargs):
        raise AssertionError("a refused payload reached the server")

    monkeypatch.setattr(served_module, "_request", no_request)
    with pytest.raises(PayloadError, match="replay"):
        receiver.receive(wire, QUESTIONS[1])
    with pytest.raises(PayloadError, match="not authenticated"):
        receiver.receive(payload.to_bytes(), QUESTIONS[1])
    with pytest.raises(PayloadError):
        receiver.receive(wire[:-1] + bytes([wire[-1] ^ 1]), QUESTIONS[1])


def test_a_server_of_another_model_is_refused(server, tiny_vllm_lm, tiny_lm_builder, vllm_folder):
    tiny_lm_builder(vllm_folder / "other-lm", seed=1)
    other = load_embedding_lm(vllm_folder / "other-lm")
    with pytest.raises(ModelMismatchError, match="embedding table with digest"):
        ServedDecoder(server.url, other)
    mine = load_embedding_lm(vllm_folder / "tiny-lm")
    with pytest.raises(ModelMismatchError, match="trained on LM 0123456789abcdef"):
        ServedDecoder(server.url, mine, fingerprint="0123456789abcdef")


def test_a_silent_or_absent_server_is_one_error_within_the_timeout(vllm_folder):
    lm = load_embedding_lm(vllm_folder / "tiny-lm")
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        start = time.monotonic()
        with pytest.raises(ServerError, match=rf"no answer from {url}/models within 1 s"):
            ServedDecoder(url, lm, timeout=1)
        assert time.monotonic() - start < 5
    with pytest.raises(ServerError, match="no answer from .*is the server running"):
        ServedDecoder(f"http://127.0.0.1:{_free_port()}/v1", lm, timeout=1)


def test_zz_a_stopped_server_is_one_error_within_the_timeout(server, served_receiver, tiny_handoff):
    payload = tiny_handoff.send(CONTEXTS[0]).to_bytes()
    assert isinstance(served_receiver.receive(payload, QUESTIONS[0]), str)
    server.stop()
    served_receiver.decoder.timeout = 5
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"no answer from {server.url}/completions"):
        served_receiver.receive(payload, QUESTIONS[0])
    assert time.monotonic() - start < 10

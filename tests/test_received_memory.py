"""Receive once, ask many: `ILCPHandoff.open` checks, unseals and projects a wire once; the
received memory answers any number of questions as `receive` would, each prefilling only its own
positions after the shared [memory ; prompt] part; a refused receive or open spends no nonce; the
number of questions is bounded before anything is tokenised or opened."""

import time

import pytest
import torch

from ilcp.handoff import ILCPHandoff
from ilcp.receiver.memory import ReceivedMemory
from ilcp.receiver.prefix import ReceiverPrefix, question_stem, receiver_prefix
from ilcp.receiver.receive import MAX_RECEIVE_QUESTIONS
from ilcp.wire.payload import PayloadError
from ilcp.wire.seal import ReplayGuard, open_envelope, seal

KEY = b"k" * 32
CONTEXT = "John travelled to the hallway. Mary journeyed to the bathroom. Daniel went back to the garden."
OTHER = "Sandra moved to the kitchen. John went to the office."
QUESTIONS = ["Where is John?", "Where is Mary?", "Where is Daniel?", "Who went to the garden?", "Where is the milk?",
             "Is Mary in the bathroom?", "Where was John before?", "What did Daniel do?", "Where is Sandra?",
             "Who travelled?"]


@pytest.fixture(scope="module")
def handoff(tiny_run, tiny_lm):
    return ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)


@pytest.fixture
def keyed(tiny_run, tiny_lm):
    """A receiver with a shared key (its replay guard fresh for each test)."""
    return ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)


def sealed(handoff, context: str = CONTEXT) -> bytes:
    return seal(handoff.send(context).to_bytes(), KEY)


@pytest.fixture
def no_stops(monkeypatch):
    """Greedy decoding without stop tokens, each answer its token ids written out: the tiny run
    ends its answers at once or with ids its small vocabulary decodes to nothing, and equal empty
    answers would prove little."""
    for module in ("ilcp.receiver.decoding", "ilcp.receiver.memory"):
        monkeypatch.setattr(f"{module}.stop_token_ids", lambda model, tokenizer: set())
        monkeypatch.setattr(f"{module}.decoded_answer", lambda tokenizer, ids, stop_at_newline: str(ids))


class Forwards:
    """Counts the positions of every forward of a model (its inputs_embeds' width)."""

    def __init__(self, model, monkeypatch):
        self.widths: list[int] = []
        forward = model.forward

        def counted(*args, **kwargs):
            embeds = kwargs.get("inputs_embeds")
            self.widths.append(None if embeds is None else int(embeds.shape[1]))
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)


# ------------------------------------------------------------------------------- the answers

def test_ten_questions_after_one_open_answer_as_receive_does(handoff, no_stops):
    wire = handoff.send(CONTEXT).to_bytes()
    memory = handoff.open(wire)
    assert isinstance(memory, ReceivedMemory) and len(memory) == 1
    expected = [handoff.receive(wire, q, max_new_tokens=6) for q in QUESTIONS]
    assert [memory.ask(q, max_new_tokens=6) for q in QUESTIONS] == expected
    assert memory.ask(QUESTIONS, max_new_tokens=6, batch_size=3) == expected
    assert memory.ask(QUESTIONS[:4], max_new_tokens=6, batch_size=1) == expected[:4]
    assert all(len(eval(answer)) == 6 for answer in expected), expected


def test_answer_tokens_equal_the_whole_prefix_decode(handoff, tiny_lm, no_stops):
    """Not only the (possibly short) texts: the ids each question decodes after the cached part are
    the ids greedy decoding gives from the whole prefix."""
    from ilcp.receiver.decoding import greedy_decode_ids, stop_token_ids
    from ilcp.receiver.stem_decoding import greedy_after_stem, prefill_stem

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    memory = handoff.open(handoff.send(CONTEXT).to_bytes())
    vectors = memory.vectors[0]
    stem = question_stem(tok, source=handoff.encoder, memory=vectors)
    cache = prefill_stem(model, stem.embeds(model))
    prefixes = [receiver_prefix(tok, q, source=handoff.encoder, memory=vectors) for q in QUESTIONS]
    table = model.get_input_embeddings()
    rests = [table(torch.tensor(p.rest_after(stem))) for p in prefixes]
    got = greedy_after_stem(model, tok, cache, len(stem), rests, max_new_tokens=6, stop_at_newline=False,
                            stops=stop_token_ids(model, tok))
    assert all(len(row) == 6 for row in got)
    assert got == greedy_decode_ids(model, tok, [p.embeds(model) for p in prefixes], max_new_tokens=6)
    assert prefill_stem(model, stem.embeds(model)).get_seq_length() == cache.get_seq_length() == len(stem)


def test_each_question_s_first_logits_equal_those_of_its_whole_prefix(handoff, tiny_lm):
    """The tiny run answers most questions alike: the logits tell the cached prefill from the
    whole one, where the answers cannot."""
    from ilcp import compat
    from ilcp.receiver.stem_decoding import batch_copy, prefill_stem

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    vectors = handoff.open(handoff.send(CONTEXT).to_bytes()).vectors[0]
    stem = question_stem(tok, source=handoff.encoder, memory=vectors)
    cache = prefill_stem(model, stem.embeds(model))
    table = model.get_input_embeddings()
    firsts = []
    with torch.inference_mode():
        for q in QUESTIONS[:4]:
            prefix = receiver_prefix(tok, q, source=handoff.encoder, memory=vectors)
            whole = model(inputs_embeds=prefix.embeds(model)[None]).logits[0, -1]
            rest = prefix.rest_after(stem)
            cached = model(inputs_embeds=table(torch.tensor([rest])),
                           position_ids=torch.arange(len(stem), len(prefix))[None], use_cache=True,
                           **compat.cache_kwargs(model, batch_copy(cache, 1))).logits[0, -1]
            torch.testing.assert_close(cached, whole, rtol=1e-4, atol=1e-5)
            firsts.append(whole)
    assert cache.get_seq_length() == len(stem)  # the stem's own cache is never written
    assert not torch.allclose(firsts[0], firsts[1])  # the question changes what is read


def test_the_shared_part_is_prefilled_once_and_each_question_prefills_its_own_positions(handoff, tiny_lm,
                                                                                       monkeypatch):
    tok = tiny_lm.tokenizer
    memory = handoff.open(handoff.send(CONTEXT).to_bytes())
    stem = question_stem(tok, source=handoff.encoder, memory=memory.vectors[0])
    whole = [len(receiver_prefix(tok, q, source=handoff.encoder, memory=memory.vectors[0])) for q in QUESTIONS]
    assert memory.positions == handoff.num_memory_tokens
    assert memory.positions < len(stem) < min(whole)  # the memory, then the prompt before the question
    forwards = Forwards(tiny_lm.model, monkeypatch)
    memory.ask(QUESTIONS[0], max_new_tokens=1)
    assert forwards.widths == [len(stem), whole[0] - len(stem)]
    for q, n in zip(QUESTIONS[1:], whole[1:]):
        forwards.widths.clear()
        memory.ask(q, max_new_tokens=1)
        assert forwards.widths == [n - len(stem)], q


def test_a_question_whose_prompt_does_not_start_with_the_shared_part_is_decoded_whole(handoff, monkeypatch, no_stops):
    wire = handoff.send(CONTEXT).to_bytes()
    expected = [handoff.receive(wire, q, max_new_tokens=6) for q in QUESTIONS[:3]]
    memory = handoff.open(wire)
    rest_after = ReceiverPrefix.rest_after
    monkeypatch.setattr(ReceiverPrefix, "rest_after",
                        lambda self, stem: None if "Mary" in str(self.segments[-1]) or len(self) % 2 else
                        rest_after(self, stem))
    assert memory.ask(QUESTIONS[:3], max_new_tokens=6) == expected
    monkeypatch.setattr(ReceiverPrefix, "rest_after", lambda self, stem: None)
    assert memory.ask(QUESTIONS[:3], max_new_tokens=6) == expected


def test_memory_placed_in_the_prompt_answers_as_receive_does(tiny_run, tiny_lm, no_stops):
    handoff = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    handoff.encoder.placement = "in_prompt"
    wire = handoff.send(CONTEXT).to_bytes()
    memory = handoff.open(wire)
    stem = question_stem(tiny_lm.tokenizer, source=handoff.encoder, memory=memory.vectors[0])
    assert stem.memory_span[0] > 0  # the cold-read prompt's head stands before the memory
    assert memory.ask(QUESTIONS[:5], max_new_tokens=5) == [handoff.receive(wire, q, max_new_tokens=5)
                                                           for q in QUESTIONS[:5]]


def test_a_payload_of_two_contexts_opens_into_two_memories(handoff, no_stops):
    wire = handoff.send([CONTEXT, OTHER]).to_bytes()
    with pytest.raises(PayloadError, match="without a question count"):
        handoff.open(wire)
    memory = handoff.open(wire, contexts=2)
    assert len(memory) == 2 and memory[1] is memory[-1] and list(memory) == [memory[0], memory[1]]
    expected = handoff.receive(wire, [QUESTIONS[0], QUESTIONS[8]], max_new_tokens=5)
    assert [memory[0].ask(QUESTIONS[0], max_new_tokens=5), memory[1].ask(QUESTIONS[8], max_new_tokens=5)] == expected
    with pytest.raises(ValueError, match=r"holds 2 contexts: ask one of them, memory\[i\]\.ask"):
        memory.ask(QUESTIONS[0])
    with pytest.raises(IndexError, match="context 2 is out of range"):
        memory[2]
    assert [m.reconstruct(max_new_tokens=6) for m in memory] == handoff.reconstruct(wire, 6, contexts=2)


def test_reconstruct_and_prefix_equal_the_receiver_s(handoff, no_stops):
    wire = handoff.send(CONTEXT).to_bytes()
    memory = handoff.open(wire)
    assert memory.reconstruct(max_new_tokens=8) == handoff.reconstruct(wire, 8)[0]
    assert torch.equal(handoff.open(handoff.send(CONTEXT)).vectors, memory.vectors)  # a payload object opens too
    torch.testing.assert_close(memory.prefix(QUESTIONS[0]), handoff.prefixes(wire, [QUESTIONS[0]])[0],
                               rtol=0, atol=0)


# ------------------------------------------------------------------------- sealed: one open

def test_a_sealed_wire_answers_ten_questions_after_one_open_and_is_opened_once(keyed, handoff, no_stops):
    wire = sealed(keyed)
    expected = [handoff.receive(handoff.send(CONTEXT).to_bytes(), q, max_new_tokens=5) for q in QUESTIONS]
    memory = keyed.open(wire)
    assert len(keyed.replay_guard) == 1
    assert [memory.ask(q, max_new_tokens=5) for q in QUESTIONS] == expected
    assert len(keyed.replay_guard) == 1  # questions do not touch the guard
    for again in (lambda: keyed.open(wire), lambda: keyed.receive(wire, QUESTIONS[0])):
        with pytest.raises(PayloadError, match="replayed payload"):
            again()


def test_a_refused_receive_spends_no_nonce(keyed):
    """Each refusal of an argument leaves the sealed bytes to be received again, corrected."""
    wire = sealed(keyed)
    limit = keyed.lm.model.config.max_position_embeddings
    long_question = "why " * (limit - 60)  # fits the LM alone, not with 200 new tokens
    refusals = [
        (dict(max_new_tokens=100_000), "plus 100000 new tokens exceeds this LM's context"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(stop_at_newline="yes"), "stop_at_newline must be True or False"),
        (dict(question=long_question, max_new_tokens=200), "new tokens exceeds this LM's context"),
        (dict(question=[QUESTIONS[0], QUESTIONS[1]]), r"holds 1 latent\(s\) but 2 question\(s\) were given"),
    ]
    for kwargs, message in refusals:
        question = kwargs.pop("question", QUESTIONS[0])
        with pytest.raises((ValueError, PayloadError), match=message):
            keyed.receive(wire, question, **kwargs)
        assert len(keyed.replay_guard) == 0, kwargs
    assert isinstance(keyed.receive(wire, QUESTIONS[0], max_new_tokens=3), str)
    with pytest.raises(PayloadError, match="replayed payload"):
        keyed.receive(wire, QUESTIONS[0], max_new_tokens=3)


def test_the_long_question_is_refused_only_after_the_seal_is_opened_and_its_nonce_released(keyed, monkeypatch):
    """The exact prompt length is known once the memory is: that refusal comes after the guard
    checked the nonce, and the guard releases it."""
    wire = sealed(keyed)
    released = []
    release = ReplayGuard.release
    monkeypatch.setattr(ReplayGuard, "release", lambda self, env: (released.append(env.nonce), release(self, env)))
    limit = keyed.lm.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="new tokens exceeds"):
        keyed.receive(wire, "why " * (limit - 60), max_new_tokens=200)
    assert released == [open_envelope(wire, KEY).nonce] and len(keyed.replay_guard) == 0


def test_a_refused_open_spends_no_nonce(keyed):
    wire = sealed(keyed)
    for contexts, message in ((0, "contexts must be a positive int"), ("1", "contexts must be a positive int"),
                              (2, r"holds 1 latent\(s\) but 2 question\(s\)")):
        with pytest.raises((ValueError, PayloadError), match=message):
            keyed.open(wire, contexts=contexts)
        assert len(keyed.replay_guard) == 0
    assert keyed.open(wire, contexts=1).ask(QUESTIONS[0], max_new_tokens=2) is not None


def test_a_memory_whose_projection_is_refused_spends_no_nonce(keyed, monkeypatch):
    wire = sealed(keyed)
    monkeypatch.setattr(type(keyed.encoder), "memory", lambda self, z, dtype=None: torch.full((1, 2, 64), torch.nan))
    with pytest.raises(PayloadError, match="non-finite memory vectors"):
        keyed.open(wire)
    assert len(keyed.replay_guard) == 0
    monkeypatch.undo()
    assert len(keyed.open(wire)) == 1


def test_two_threads_opening_one_sealed_wire_get_one_memory(keyed):
    """The nonce is held from the seal's check on: a concurrent open of the same bytes is a
    replay even while the first is still projecting, and its refusal releases nothing."""
    import threading

    wire = sealed(keyed)
    barrier = threading.Barrier(2)
    results = []

    def open_it():
        barrier.wait()
        try:
            results.append(keyed.open(wire))
        except PayloadError as e:
            results.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(type(r).__name__ for r in results) == ["PayloadError", "ReceivedMemory"]
    assert "replayed payload" in str(next(r for r in results if isinstance(r, PayloadError)))
    assert len(keyed.replay_guard) == 1


# ------------------------------------------------------------------------------ bounds

@pytest.fixture
def no_tokenizing(tiny_lm, monkeypatch):
    cls = type(tiny_lm.tokenizer)

    def refuse(self, *args, **kwargs):
        raise AssertionError("the tokenizer was called")

    monkeypatch.setattr(cls, "__call__", refuse)
    monkeypatch.setattr(cls, "encode", refuse)
    monkeypatch.setattr(cls, "apply_chat_template", refuse)


def test_70000_questions_are_refused_at_once_before_anything_is_tokenised_or_opened(keyed, no_tokenizing):
    """The payload is never read: bytes that are no payload at all get the count's refusal."""
    questions = ["Where is John?"] * 70_000
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        keyed.receive(b"not a payload", questions)
    message = str(caught.value)
    assert "\n" not in message
    for words in ("70,000 questions were given in one call, more than 1,024", "MAX_RECEIVE_QUESTIONS",
                  "ask them in several calls"):
        assert words in message, (words, message)
    for call in (lambda: keyed.open(b"not a payload", contexts=70_000),
                 lambda: keyed.prefixes(b"not a payload", questions)):
        with pytest.raises(ValueError, match="70,000 contexts in one call, more than 1,024"):
            call()
    assert time.monotonic() - start < 2 and len(keyed.replay_guard) == 0


def test_the_question_count_is_bounded_for_a_received_memory_too(handoff, tiny_lm, monkeypatch):
    memory = handoff.open(handoff.send(CONTEXT).to_bytes())
    forwards = Forwards(tiny_lm.model, monkeypatch)
    with pytest.raises(ValueError, match=f"{MAX_RECEIVE_QUESTIONS + 1:,} questions were given in one call"):
        memory.ask(["Where is John?"] * (MAX_RECEIVE_QUESTIONS + 1))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        memory.ask("Where is John?", max_new_tokens=0)
    with pytest.raises(ValueError, match="plus 100000 new tokens exceeds"):
        memory.ask("Where is John?", max_new_tokens=100_000)
    assert forwards.widths == []
    assert len(memory.ask(["Where is John?"] * 3, max_new_tokens=1)) == 3


# -------------------------------------------------------------------------- the guard's release

def test_the_replay_guard_releases_a_nonce_and_nothing_else():
    guard = ReplayGuard(max_age=None, max_nonces=2)
    first, second = (open_envelope(seal(b"payload", KEY), KEY) for _ in range(2))
    guard.check(first)
    with pytest.raises(PayloadError, match="replayed payload"):
        guard.check(first)
    guard.release(second)  # not held: nothing
    assert len(guard) == 1
    guard.release(first)
    assert len(guard) == 0
    guard.check(first)
    guard.check(second)
    assert len(guard) == 2 and len(guard._by_time) == 2  # no stale entry left behind to evict later


# ------------------------------------------------------------------ SmolLM2, shipped encoder

@pytest.mark.slow
def test_smollm2_answers_ten_questions_after_one_open_as_receive_does(smollm2):
    from pathlib import Path

    shipped = Path(__file__).resolve().parent.parent / "pretrained" / "smollm2-memory"
    sender = ILCPHandoff.from_pretrained(shipped, lm=smollm2, auth_key=KEY, precision="32-true")
    receiver = ILCPHandoff.from_pretrained(shipped, lm=smollm2, auth_key=KEY, precision="32-true")
    payload = sender.send(CONTEXT)
    assert payload.latent.dim() == 2  # memory slots: several latents for one context
    memory = receiver.open(sender.to_wire(payload))
    answers = [memory.ask(q, max_new_tokens=8) for q in QUESTIONS]
    expected = [receiver.receive(sender.to_wire(payload), q, max_new_tokens=8) for q in QUESTIONS]
    assert answers == expected and any(answers)
    assert memory.ask(QUESTIONS, max_new_tokens=8, batch_size=4) == expected

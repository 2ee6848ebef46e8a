"""`Agent.ask`: several questions over one delivered handoff. Its answers are those of the path
that prefills every question whole (a transfer per question, pop, greedy generate), the part the
questions share is prefilled once, asking changes nothing of the agent, and bad input is refused
in one line before any forward."""

import asyncio
import json

import pytest
import torch

from _benchmarks import load_benchmark
from ilcp import rclc
from ilcp.rclc import backends, questions

STORY = (
    "John travelled to the hallway. Mary journeyed to the bathroom. Daniel went back to the "
    "bathroom. Sandra moved to the kitchen. Cedar is owned by Alice. Birch was launched in 1994."
)
HISTORY_X = [{"role": "user", "content": STORY}]
HISTORY_Y = [{"role": "system", "content": "Answer the question with one word."}]
QUESTIONS = ["Where is John?", "Who owns Cedar?", "When was Birch launched?"]
SLOT = "Context:\n{context}\nQuestion: {request}"


@pytest.fixture
def lm(tiny_lm):
    return tiny_lm.model, tiny_lm.tokenizer


@pytest.fixture
def forwards(tiny_lm):
    """The positions of every forward of the tiny LM's decoder, in order."""
    positions = []

    def count(module, args, kwargs):
        rows = kwargs.get("inputs_embeds")
        positions.append(int((rows if rows is not None else kwargs["input_ids"]).shape[1]))

    handle = tiny_lm.model.model.register_forward_pre_hook(count, with_kwargs=True)
    yield positions
    handle.remove()


@pytest.fixture
def generations(tiny_lm, monkeypatch):
    """Every ``model.generate`` output (with its scores), whoever calls it."""
    model = tiny_lm.model
    real = model.generate
    outputs = []

    def recording(**kwargs):
        out = real(**kwargs, output_scores=True)
        outputs.append(out)
        return out

    monkeypatch.setattr(model, "generate", recording)
    return outputs


def _bind(model, tokenizer, placement="prefix", messages=HISTORY_Y, **kwargs):
    kwargs.setdefault("max_new_tokens", 5)
    slot = {"slot_template": SLOT} if placement == "in_prompt" else {}
    return rclc.bind(model, tokenizer, messages=messages, placement=placement, **slot, **kwargs)


def _state(agent):
    """What asking must leave as it was."""
    return (agent._explicit, agent._history, agent._pending, [d for d, _ in agent.queued()],
            [p for _, p in agent.queued()])


def _per_question(model, tokenizer, sender, request_of, questions_asked, placement="prefix", messages=HISTORY_Y,
                  **transfer):
    """Each question the long way: a fresh receiver, its own transfer, pop, greedy generate.
    Returns the pops' inputs and the generate outputs."""
    inputs, outputs = [], []
    for q in questions_asked:
        agent = _bind(model, tokenizer, placement, messages)
        rclc.transfer_sync(sender, agent, request_of(q), **transfer)
        popped = agent.pop(prompt=None if request_of(q) is q else q)
        inputs.append(popped)
        outputs.append(model.generate(**popped, do_sample=False, return_dict_in_generate=True))
    return inputs, outputs


def _same_generations(asked, per):
    assert len(asked) == len(per)
    for a, b in zip(asked, per):
        assert torch.equal(a.sequences, b.sequences)
        for sa, sb in zip(a.scores, b.scores):
            torch.testing.assert_close(sa, sb, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("placement", ["prefix", "in_prompt"])
def test_a_question_blind_transfer_answers_as_a_transfer_per_question(lm, generations, placement):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    y = _bind(model, tokenizer, placement)
    rclc.transfer_sync(x, y, "Where is Mary?", selector=rclc.selectors.reread)
    answers = asyncio.run(y.ask(QUESTIONS))
    asked = generations[:]
    inputs, per = _per_question(model, tokenizer, x, lambda q: q, QUESTIONS, placement,
                                selector=rclc.selectors.reread)
    # reread does not read the request: each question's own transfer delivers the same rows
    delivered = y.queued()[0][0].rows(model.get_input_embeddings().weight)
    for popped in inputs:
        assert any(torch.equal(popped["inputs_embeds"][0, i:i + len(delivered)], delivered)
                   for i in range(popped["inputs_embeds"].shape[1] - len(delivered) + 1))
    _same_generations(asked, per)
    assert answers == [tokenizer.decode(o.sequences[0], skip_special_tokens=True).strip() for o in per]


def test_a_question_aware_transfer_answers_as_pop_with_each_question(lm, generations):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    y = _bind(model, tokenizer, "in_prompt")
    rclc.transfer_sync(x, y, "Where is Mary?", ratio=2)  # cacheback, the default: rows for this request
    answer = asyncio.run(y.ask(QUESTIONS[0]))
    answers = asyncio.run(y.ask(QUESTIONS[1:]))
    assert isinstance(answer, str) and isinstance(answers, list) and len(answers) == 2
    asked = generations[:]
    _, per = _per_question(model, tokenizer, x, lambda q: "Where is Mary?", QUESTIONS, "in_prompt", ratio=2)
    _same_generations(asked, per)
    assert [answer, *answers] == [tokenizer.decode(o.sequences[0], skip_special_tokens=True).strip() for o in per]


def test_the_shared_part_is_prefilled_once(lm, forwards, generations):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    y = _bind(model, tokenizer, "in_prompt")
    rclc.transfer_sync(x, y, "Where is Mary?", selector=rclc.selectors.reread)
    received = y.queued()[0][0].positions
    forwards.clear()
    asyncio.run(y.ask(QUESTIONS[:2]))
    asyncio.run(y.ask(QUESTIONS[2]))  # a later call reuses it
    asked, counted = generations[:], forwards[:]
    inputs, _ = _per_question(model, tokenizer, x, lambda q: q, QUESTIONS, "in_prompt",
                              selector=rclc.selectors.reread)
    whole = [p["inputs_embeds"].shape[1] for p in inputs]
    shared = counted[0]
    assert received < shared < min(whole)
    for p in inputs[1:]:  # it is a part every question's inputs start with
        assert torch.equal(p["inputs_embeds"][0, :shared], inputs[0]["inputs_embeds"][0, :shared])
    expected = [shared]
    for n, out in zip(whole, asked):
        expected += [n - shared] + [1] * (out.sequences.shape[1] - 1)
    assert counted == expected

    # a changed history changes the shared part: it is prefilled again, for the new history
    y2 = _bind(model, tokenizer, "in_prompt", messages=list(HISTORY_Y))
    rclc.transfer_sync(x, y2, "Where is Mary?", selector=rclc.selectors.reread)
    asyncio.run(y2.ask(QUESTIONS[0]))
    y2.messages[1:] = [{"role": "user", "content": "Be brief."}, {"role": "assistant", "content": "Yes."}]
    forwards.clear()
    del generations[:]
    asyncio.run(y2.ask(QUESTIONS[0]))
    counted, asked = forwards[:], generations[:]
    inputs, per = _per_question(model, tokenizer, x, lambda q: q, QUESTIONS[:1], "in_prompt", list(y2.messages),
                                selector=rclc.selectors.reread)
    _same_generations(asked, per)
    longer = counted[0]
    assert longer > shared
    assert counted == [longer, inputs[0]["inputs_embeds"].shape[1] - longer] + [1] * (asked[0].sequences.shape[1] - 1)


def test_token_id_questions_share_the_rows(lm, forwards, generations):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    y = _bind(model, tokenizer, messages=None)  # no history: token-ID questions are allowed
    rclc.transfer_sync(x, y, "Where is Mary?", selector=rclc.selectors.reread)
    received = y.queued()[0][0].positions
    ids = torch.tensor([tokenizer("Who owns Cedar?", add_special_tokens=False)["input_ids"]])
    forwards.clear()
    answers = asyncio.run(y.ask([ids, QUESTIONS[0]]))
    assert len(answers) == 2
    asked, counted = generations[:], forwards[:]
    inputs, per = [], []
    for q in (ids, QUESTIONS[0]):
        agent = _bind(model, tokenizer, messages=None)
        rclc.transfer_sync(x, agent, "Where is Mary?", selector=rclc.selectors.reread)
        inputs.append(agent.pop(prompt=q))
        per.append(model.generate(**inputs[-1], do_sample=False, return_dict_in_generate=True))
    _same_generations(asked, per)
    # the rows and the chat prompt before a string question are prefilled once; the IDs, which
    # follow the rows directly, share the rows and prefill only themselves
    shared = counted[0]
    assert shared > received
    expected = [shared, ids.shape[1]] + [1] * (asked[0].sequences.shape[1] - 1)
    expected += [inputs[1]["inputs_embeds"].shape[1] - shared] + [1] * (asked[1].sequences.shape[1] - 1)
    assert counted == expected


def test_a_request_before_the_rows_shares_nothing_and_still_answers(lm, forwards, generations):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    settings = {"messages": HISTORY_Y, "max_new_tokens": 4, "placement": "in_prompt",
                "slot_template": "Question: {request}\nContext:\n{context}"}
    y = rclc.bind(model, tokenizer, **settings)
    rclc.transfer_sync(x, y, "Where is Mary?", selector=rclc.selectors.reread)
    forwards.clear()
    asyncio.run(y.ask(QUESTIONS[:2]))
    counted, asked = forwards[:], generations[:]
    inputs, per = [], []
    for q in QUESTIONS[:2]:
        agent = rclc.bind(model, tokenizer, **settings)
        rclc.transfer_sync(x, agent, q, selector=rclc.selectors.reread)
        inputs.append(agent.pop())
        per.append(model.generate(**inputs[-1], do_sample=False, return_dict_in_generate=True))
    _same_generations(asked, per)
    expected = []  # each question prefilled whole: no part holding the rows comes before the question
    for p, out in zip(inputs, asked):
        expected += [p["inputs_embeds"].shape[1]] + [1] * (out.sequences.shape[1] - 1)
    assert counted == expected


def test_asking_changes_nothing_of_the_agent(lm):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    y = _bind(model, tokenizer, "in_prompt")
    twin = _bind(model, tokenizer, "in_prompt")
    for agent in (y, twin):
        rclc.transfer_sync(x, agent, "Where is Mary?")
        rclc.transfer_sync(x, agent, "Who owns Cedar?")
    pending = asyncio.run(y.inputs(max_new_tokens=3))  # asking is allowed while inputs are pending
    before = _state(y)
    asyncio.run(y.ask(QUESTIONS))
    asyncio.run(y.ask(QUESTIONS[0], request_index=1, max_new_tokens=2))
    after = _state(y)
    assert all(a is b for a, b in zip(before[:3], after[:3]))
    assert all(a is b for a, b in zip(before[3], after[3])) and all(a is b for a, b in zip(before[4], after[4]))
    assert y.pending.inputs is pending and len(y) == 2
    y.update(inputs=pending, generation=model.generate(**pending, do_sample=False, return_dict_in_generate=True))
    assert torch.equal(y.pop()["inputs_embeds"], twin.pop()["inputs_embeds"])  # the queue pops as it would have


def _one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_bad_input_is_refused_in_one_line_before_any_forward(lm, forwards):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    empty = _bind(model, tokenizer)
    with pytest.raises(IndexError, match="none is queued") as e:
        asyncio.run(empty.ask("Where is John?"))
    _one_line(e)
    y = _bind(model, tokenizer, context_limit=120)
    rclc.transfer_sync(x, y, "Where is Mary?")
    before = _state(y)
    forwards.clear()
    cases = [
        (([],), {}, ValueError, "at least one question"),
        ((3,), {}, TypeError, "questions must be a string"),
        ((["Where is John?", 3],), {}, TypeError, "question 1 must be a string"),
        (("Where is John?",), {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        (("Where is John?",), {"request_index": True}, TypeError, "request_index must be an int"),
        (("Where is John?",), {"request_index": 1}, IndexError, "no queued handoff at request_index=1"),
        ((torch.tensor([[5, 6]]),), {}, ValueError, "question 0: a token-ID request cannot follow chat history"),
        ((["Where is John?", "\ud800"],), {}, ValueError, "question 1: .*lone surrogate"),
        (("Where is John?",), {"max_new_tokens": 100}, ValueError, "question 0: .*exceed the context limit of 120"),
    ]
    for args, kwargs, kind, match in cases:
        with pytest.raises(kind, match=match) as e:
            asyncio.run(y.ask(*args, **kwargs))
        _one_line(e)
    assert forwards == []
    after = _state(y)
    assert all(a is b for a, b in zip(before[:3], after[:3])) and len(y) == 1

    blind = rclc.bind(model, None, prompt=torch.tensor([[5, 6, 7]]))
    rclc.transfer_sync(x, blind, torch.tensor([[8, 9]]))
    forwards.clear()
    with pytest.raises(ValueError, match="bind the agent with its tokenizer") as e:
        asyncio.run(blind.ask(torch.tensor([[8, 9]])))
    _one_line(e)
    assert forwards == []

    served = _bind(model, tokenizer)
    rclc.transfer_sync(x, served, "Where is Mary?")
    served._backend = type("VLLMNamed", (backends.HFBackend,), {"name": "vllm"})(model, tokenizer)
    forwards.clear()
    with pytest.raises(ValueError, match="backend='hf' only") as e:
        asyncio.run(served.ask("Where is John?"))
    assert _one_line(e) == questions.VLLM_REFUSAL
    assert forwards == []


def test_a_second_ask_waits_for_the_first_and_a_cancelled_one_keeps_the_agent(lm, monkeypatch):
    model, tokenizer = lm
    x = rclc.bind(model, tokenizer, messages=HISTORY_X)
    y = _bind(model, tokenizer)
    rclc.transfer_sync(x, y, "Where is Mary?")
    real = model.generate

    def slow(**kwargs):
        import time

        time.sleep(0.3)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", slow)

    async def twice():
        first = asyncio.ensure_future(y.ask(QUESTIONS[0]))
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="ask\\(\\) while ask\\(\\) is in progress"):
            await y.ask(QUESTIONS[1])
        return await first

    assert isinstance(asyncio.run(twice()), str)
    before = _state(y)

    async def cancelled():
        task = asyncio.ensure_future(y.ask(QUESTIONS))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    after = _state(y)
    assert all(a is b for a, b in zip(before[:3], after[:3])) and y._busy is None and len(y) == 1
    assert isinstance(asyncio.run(y.ask(QUESTIONS[0])), str)


def test_the_benchmark_times_both_paths(tmp_path, capsys):
    bench = load_benchmark("rclc_ask_many")
    out = tmp_path / "rclc_ask_many.json"
    assert bench.main(["--lm", "tiny-qwen3", "--questions", "3", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["question"] for r in rows] == bench.QUESTIONS[:3]
    assert report["shared_positions"] > report["received_positions"] > 0
    for i, r in enumerate(rows):
        assert r["pop_s"] > 0 and r["ask_s"] > 0
        own = r["pop_positions"] - report["shared_positions"]
        assert r["ask_positions"] == (r["pop_positions"] if i == 0 else own) and own > 0
    assert report["later_ask_s"] == pytest.approx(sum(r["ask_s"] for r in rows[1:]) / 2)
    printed = capsys.readouterr().out
    assert len([line for line in printed.splitlines() if line.startswith("| ") and "---" not in line]) == 1 + 3
    assert "questions 2..3: pop + generate" in printed


def test_the_benchmark_refuses_an_unknown_lm_in_one_line(capsys):
    assert load_benchmark("rclc_ask_many").main(["--lm", "no-such-lm"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "rclc_ask_many.py: error: unknown LM spec" in err


@pytest.mark.slow
def test_smollm2_answers_as_a_transfer_per_question(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    notes = [{"role": "user", "content": "Cedar is a small boat owned by Alice. Birch is a satellite launched "
                                         "in 1994. Alice keeps Cedar in the harbour of Oslo."}]
    x = rclc.bind(model, tokenizer, messages=notes)
    asked = ["Who owns Cedar?", "When was Birch launched?", "Where is Cedar kept?"]
    y = rclc.bind(model, tokenizer, messages=HISTORY_Y, max_new_tokens=8, placement="in_prompt", slot_template=SLOT)
    rclc.transfer_sync(x, y, "What do the notes say?", ratio=2, selector=rclc.selectors.reread)
    answers = asyncio.run(y.ask(asked))
    expected = []
    for q in asked:
        agent = rclc.bind(model, tokenizer, messages=HISTORY_Y, max_new_tokens=8, placement="in_prompt",
                          slot_template=SLOT)
        rclc.transfer_sync(x, agent, q, ratio=2, selector=rclc.selectors.reread)
        tokens = model.generate(**agent.pop(), do_sample=False)
        expected.append(tokenizer.decode(tokens[0], skip_special_tokens=True).strip())
    assert answers == expected and all(answers)

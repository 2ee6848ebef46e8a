"""One receiver prefix: training's teacher-forced sequences, validation decoding, ILCPHandoff,
the evaluation methods and the vLLM receivers all read the rows `ilcp.receiver.prefix.receiver_prefix`
builds, and those rows are the layout the prompts module describes."""

import copy
from types import SimpleNamespace

import pytest
import torch

from ilcp.receiver import prompts
from ilcp.receiver.decoding import assemble_prefix
from ilcp.encoder.model import ConstantMemory, FormatPrompt
from ilcp.evaluation.methods import ColdRead, ColdReadTuned, NoContext, PromptTuned
from ilcp.evaluation.registry import Sent
from ilcp.handoff import ILCPHandoff
from ilcp.receiver.prefix import MemoryLayout, receiver_prefix
from ilcp.training.handoff_stage import HandoffModule

CONTEXT = "John went to the garden. Mary moved to the hallway."
QUESTION = "Where is John?"
ANSWER = "garden"


@pytest.fixture
def handoff(tiny_run, tiny_lm):
    # a private copy: the layouts below change the encoder's placement and format vectors
    h = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    h.encoder = copy.deepcopy(h.encoder)
    return h


def _batch():
    return {"context": [CONTEXT], "question": [QUESTION], "answer": [ANSWER]}


def _training_prefix(module, memory, with_context):
    """The prefix part of the teacher-forced sequence training computes its loss on."""
    sequences, labels = module._answer_sequences(memory, _batch(), with_context)
    n_prefix = int((labels[0] == -100).sum())
    return sequences[0][:n_prefix], labels[0]


def _expected_ilcp(lm, memory, placement, fmt):
    """The documented layout, assembled from the prompt texts without the builder."""
    before, after = prompts.memory_prompt(lm.tokenizer, QUESTION, placement)
    parts = ([fmt] if fmt is not None else []) + ([before] if before else []) + [memory, after]
    return assemble_prefix(lm.model, lm.tokenizer, parts)


@pytest.mark.parametrize("placement", ["prefix", "in_prompt"])
@pytest.mark.parametrize("with_format", [False, True])
def test_ilcp_layouts_are_the_same_rows_in_training_validation_and_serving(handoff, tiny_lm, tiny_run,
                                                                           placement, with_format):
    encoder = handoff.encoder
    encoder.placement = placement
    fmt = None
    if with_format:
        torch.manual_seed(0)
        encoder.format_prompt = FormatPrompt(torch.randn(3, tiny_lm.hidden_size), trainable=False)
        fmt = encoder.format_prompt.vectors
    payload = handoff.send(CONTEXT)
    memory = handoff.memory_vectors(payload)  # (1, K, H)

    served = handoff.prefixes(payload, [QUESTION])[0]
    module = HandoffModule(encoder, tiny_lm, tiny_run.cfg.handoff)
    trained, labels = _training_prefix(module, memory, with_context=False)
    validated = module.prefix(memory[0], CONTEXT, QUESTION, with_context=False).embeds(tiny_lm.model)
    expected = _expected_ilcp(tiny_lm, memory[0], placement, fmt)

    assert torch.equal(served, expected)
    assert torch.equal(trained, expected)
    assert torch.equal(validated, expected)
    answer_ids = tiny_lm.tokenizer(prompts.answer_text(ANSWER, tiny_lm.tokenizer), add_special_tokens=False)["input_ids"]
    assert labels[-len(answer_ids):].tolist() == answer_ids


def test_the_memory_span_says_where_the_vectors_stand(handoff, tiny_lm):
    memory = torch.randn(4, tiny_lm.hidden_size)
    handoff.encoder.placement = "in_prompt"
    prefix = receiver_prefix(tiny_lm.tokenizer, QUESTION, source=handoff.encoder, memory=memory)
    start, end = prefix.memory_span
    rows = prefix.embeds(tiny_lm.model)
    assert end - start == 4 and torch.equal(rows[start:end], memory)
    before, _ = prompts.memory_prompt(tiny_lm.tokenizer, QUESTION, "in_prompt")
    assert start == len(tiny_lm.tokenizer(before, add_special_tokens=False)["input_ids"]) > 0
    handoff.encoder.placement = "prefix"
    assert receiver_prefix(tiny_lm.tokenizer, QUESTION, source=handoff.encoder, memory=memory).memory_span == (0, 4)


def _eval_context(tiny_lm, soft_prompts):
    return SimpleNamespace(lm=tiny_lm, run=SimpleNamespace(soft_prompts=soft_prompts))


def test_tuned_baselines_and_text_handoffs_match_between_training_and_eval(tiny_lm, tiny_run):
    torch.manual_seed(1)
    soft = torch.randn(5, tiny_lm.hidden_size)
    row = {"context": CONTEXT, "question": QUESTION, "answer": ANSWER}
    sent = Sent(handed_over=CONTEXT.encode("utf-8"), wire_bytes=len(CONTEXT))
    ctx = _eval_context(tiny_lm, {"prompt_tuned": soft, "cold_read_tuned": soft})
    methods = {}
    for cls in (NoContext, PromptTuned, ColdRead, ColdReadTuned):
        method = cls()
        method.ctx = ctx
        methods[cls.name] = method.receive(sent, row)

    cfg = tiny_run.cfg.handoff
    for name, reads_context in (("prompt_tuned", False), ("cold_read_tuned", True)):
        module = HandoffModule(ConstantMemory(soft, reads_context), tiny_lm, cfg)
        trained, _ = _training_prefix(module, soft.unsqueeze(0), with_context=reads_context)
        assert torch.equal(trained, methods[name]), name

    tok = tiny_lm.tokenizer
    assert torch.equal(methods["no_context"], assemble_prefix(tiny_lm.model, tok, [prompts.question_prompt(tok, QUESTION)]))
    cold = assemble_prefix(tiny_lm.model, tok, [prompts.cold_read_prompt(tok, CONTEXT, QUESTION)])
    assert torch.equal(methods["cold_read"], cold)
    # the distillation teacher reads the cold read too
    module = HandoffModule(ConstantMemory(soft, False), tiny_lm, cfg)
    teacher, _ = _training_prefix(module, None, with_context=True)
    assert torch.equal(teacher, cold)
    assert torch.equal(methods["cold_read_tuned"], torch.cat([soft, cold]))


def test_selected_rows_and_the_reconstruction_instruction_replace_the_prompt(tiny_lm):
    memory = torch.randn(2, tiny_lm.hidden_size)
    ids = [5, 6, 7]
    prefix = receiver_prefix(tiny_lm.tokenizer, QUESTION, source=MemoryLayout(reads_context_text=True),
                             memory=memory, prompt_ids=ids)
    table = tiny_lm.model.get_input_embeddings()
    assert torch.equal(prefix.embeds(tiny_lm.model), torch.cat([memory, table(torch.tensor(ids))]))
    plain = receiver_prefix(tiny_lm.tokenizer, None, memory=memory, prompt_ids=ids)
    assert plain.segments[0] is memory and plain.memory_span == (0, 2)
    with_answer = plain.embeds(tiny_lm.model, [9])
    assert with_answer.shape[0] == len(plain) + 1 and torch.equal(with_answer[-1], table.weight[9])


def test_bad_layouts_are_value_errors(tiny_lm):
    tok = tiny_lm.tokenizer
    with pytest.raises(ValueError, match="without its memory"):
        receiver_prefix(tok, QUESTION, source=MemoryLayout())
    with pytest.raises(ValueError, match="reads the context text"):
        receiver_prefix(tok, QUESTION, source=MemoryLayout(reads_context_text=True),
                        memory=torch.zeros(2, tiny_lm.hidden_size))
    with pytest.raises(ValueError, match="needs a question"):
        receiver_prefix(tok, None)
    with pytest.raises(ValueError, match=r"float \(n, H\)"):
        receiver_prefix(tok, QUESTION, source=MemoryLayout(), memory=torch.zeros(2, 3, 4))

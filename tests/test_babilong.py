"""ilcp.tasks.babilong_context: bAbI stories spread through public-domain prose to a length in the LM's tokens
(`babilong:<task>:<length>`), on the tiny LM's tokenizer."""

import json
import re
import shutil
from pathlib import Path

import pytest

from ilcp.names import parse_babilong_name, parse_length
from ilcp.tasks.babilong_context import GENERATOR_VERSION, babilong_context, story_sentences
from ilcp.tasks.background import BABI_NAMES, background_files
from ilcp.tasks import TASK_COLUMNS, load_babi, load_task, task_config_key


@pytest.fixture(scope="module")
def tokenizer(tiny_lm):
    return tiny_lm.tokenizer


def n_tokens(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def story_positions(context, story):
    """Where each story sentence starts in the context, searching after the previous one."""
    positions, at = [], 0
    for sentence in story:
        at = context.find(sentence, at)
        assert at >= 0, f"{sentence!r} missing or out of order"
        positions.append(at)
        at += len(sentence)
    return positions


# ---------------------------------------------------------------------------------------- names

@pytest.mark.parametrize("text, tokens", [
    ("0", 0), ("0k", 0), ("0.5k", 512), ("1k", 1024), ("2K", 2048), ("4k", 4096), ("1500", 1500),
    ("1.5k", 1536), (700, 700),
])
def test_lengths(text, tokens):
    assert parse_length(text) == tokens


def test_names():
    assert parse_babilong_name("babilong:1:2k") == (1, 2048, "babilong-qa1-2k", (1,))
    assert parse_babilong_name("babilong:qa3:0.5k") == (3, 512, "babilong-qa3-0.5k", (3,))
    assert parse_babilong_name("babilong:2:1500").name == "babilong-qa2-1500"
    assert parse_babilong_name("babilong:1:0").name == "babilong-qa1-0"


@pytest.mark.parametrize("name, message", [
    ("babilong:1", "needs a length"),
    ("babilong:1:", "needs a length"),
    ("babilong:1:xyz", "unknown length 'xyz'"),
    ("babilong:1:1.3k", "whole number of tokens"),
    ("babilong:1:-1k", "unknown length"),
    ("babilong:0:1k", "must be >= 1"),
    ("babilong", "babilong:<task>:<length>"),
    ("babilong:x:1k", "babilong:<task>:<length>"),
])
def test_bad_names(name, message, tokenizer):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_babilong_name(name)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_task(name, "test", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=re.escape(message)):
        task_config_key(name, "test", tokenizer=tokenizer)


def test_a_task_without_files_is_a_value_error(tokenizer, tmp_path):
    for call in (load_task, task_config_key):
        with pytest.raises(ValueError, match=r"babilong:99:1k.*qa99_\*_test\.txt"):
            call("babilong:99:1k", "test", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"qa4_\*_train\.txt"):  # task 4 is not shipped
        load_task("babilong:4:1k", "train", tokenizer=tokenizer)


def test_a_length_needs_the_tokenizer():
    with pytest.raises(ValueError, match="tokenizer="):
        load_task("babilong:1:1k", "test", limit=2)
    with pytest.raises(ValueError, match="tokenizer="):
        task_config_key("babilong:1:1k", "test")
    with pytest.raises(ValueError, match="tokenizer"):
        babilong_context(["Mary went to the kitchen."], 512)
    with pytest.raises(ValueError, match="split"):
        babilong_context(["Mary went to the kitchen."], 0, split="dev")
    with pytest.raises(ValueError, match="length"):
        babilong_context(["Mary went to the kitchen."], -1)


# -------------------------------------------------------------------------------------- contexts

@pytest.mark.parametrize("length", [512, 1024, 2048, 4096])
def test_length_is_reached_within_five_percent_never_above(tokenizer, length):
    rows = load_babi(2, "test", limit=12).to_list()
    for row in rows:
        story = story_sentences(row["context"])
        context = babilong_context(story, length, tokenizer, split="test", seed=row["id"])
        assert 0.95 * length <= n_tokens(tokenizer, context) <= length
        story_positions(context, story)


def test_facts_keep_their_order_among_background(tokenizer):
    rows = load_babi(3, "test", limit=10).to_list()
    for row in rows:
        story = story_sentences(row["context"])
        context = babilong_context(story, 2048, tokenizer, split="test", seed=row["id"])
        positions = story_positions(context, story)
        assert positions == sorted(positions)
        assert n_tokens(tokenizer, context) > n_tokens(tokenizer, row["context"]) + 500
        # the story is spread out: background between some of its sentences
        between = [context[p + len(s):q].strip() for p, s, q in zip(positions, story, positions[1:])]
        assert sum(map(bool, between)) >= 2


def test_length_zero_and_long_stories_are_the_plain_story(tokenizer):
    row = load_babi(1, "test")[0]
    story = story_sentences(row["context"])
    assert " ".join(story) == row["context"]
    assert babilong_context(story, 0) == row["context"]
    assert babilong_context(story, 5, tokenizer) == row["context"]  # the story alone is longer


def test_same_seed_same_text_other_seed_other_text(tokenizer):
    story = story_sentences(load_babi(1, "test")[0]["context"])
    first = babilong_context(story, 1024, tokenizer, split="train", seed=7)
    assert babilong_context(story, 1024, tokenizer, split="train", seed=7) == first
    assert babilong_context(story, 1024, tokenizer, split="train", seed=8) != first
    assert babilong_context(story, 1024, tokenizer, split="validation", seed=7) != first
    rows = load_task("babilong:1:0.5k", "validation", tokenizer=tokenizer, limit=5)
    assert load_task("babilong:1:0.5k", "validation", tokenizer=tokenizer, limit=5)["context"] == rows["context"]
    other = load_task("babilong:1:0.5k", "validation", tokenizer=tokenizer, limit=5, seed=1)
    assert other["context"] != rows["context"]


# ------------------------------------------------------------------------------------- the task

def test_load_task(tokenizer):
    babi = load_babi(1, "test", limit=6)
    rows = load_task("babilong:1:1k", "test", tokenizer=tokenizer, limit=6)
    assert tuple(rows.column_names) == TASK_COLUMNS and len(rows) == 6
    assert rows["question"] == babi["question"] and rows["answer"] == babi["answer"]
    assert rows["id"][0] == "babilong-qa1-1k-test-s0-q0" and set(rows["task"]) == {"babilong-qa1-1k"}
    assert len(set(rows["id"])) == 6
    for row, plain in zip(rows, babi):
        story_positions(row["context"], story_sentences(plain["context"]))
        assert n_tokens(tokenizer, row["context"]) <= 1024
    # a prefix of the rows is the rows of a smaller limit
    assert load_task("babilong:1:1k", "test", tokenizer=tokenizer, limit=3)["context"] == rows["context"][:3]
    assert load_task("babilong:1:0", "test", limit=6)["context"] == babi["context"]


def test_any_task_the_babi_directory_provides(tmp_path, monkeypatch, tokenizer):
    folder = tmp_path / "en"
    folder.mkdir()
    (folder / "qa4_made-up_test.txt").write_text(
        "1 The hall is north of the den.\n2 The den is east of the cellar.\n"
        "3 What is north of the den?\thall\t1\n")
    monkeypatch.setenv("ILCP_BABI_DIR", str(tmp_path))
    rows = load_task("babilong:4:0.5k", "test", tokenizer=tokenizer)
    assert rows["answer"] == ["hall"] and rows["id"] == ["babilong-qa4-0.5k-test-s0-q0"]
    story_positions(rows[0]["context"], ["The hall is north of the den.", "The den is east of the cellar."])
    assert task_config_key("babilong:4:0.5k", "test", tokenizer=tokenizer)["source"] == "qa4_made-up_test.txt"


def test_task_config_key(tokenizer, tmp_path):
    from ilcp.lm import build_tiny_tokenizer

    key = task_config_key("babilong:1:1k", "train", tokenizer=tokenizer)
    assert json.loads(json.dumps(key)) == key
    assert key["task"] == "babilong-qa1-1k" and key["length_tokens"] == 1024
    assert key["generator_version"] == GENERATOR_VERSION
    assert re.fullmatch(r"[0-9a-f]{16}", key["tokenizer"]) and re.fullmatch(r"[0-9a-f]{16}", key["background_sha256"])
    assert task_config_key("babilong:qa1:1024", "train", tokenizer=tokenizer) == key
    assert task_config_key("babilong:1:2k", "train", tokenizer=tokenizer) != key
    assert task_config_key("babilong:1:1k", "test", tokenizer=tokenizer) != key
    assert task_config_key("babilong:1:1k", "train", tokenizer=tokenizer, seed=1) != key
    assert task_config_key("babilong:1:1k", "train", tokenizer=tokenizer, limit=5) != key
    assert task_config_key("babilong:2:1k", "train", tokenizer=tokenizer) != key

    same = build_tiny_tokenizer()  # another object, the same tokenizer
    assert task_config_key("babilong:1:1k", "train", tokenizer=same) == key
    other = build_tiny_tokenizer()
    other.add_tokens(["kitchen"])
    assert task_config_key("babilong:1:1k", "train", tokenizer=other)["tokenizer"] != key["tokenizer"]

    # the background: same content elsewhere, same key; changed content, another key
    copy = tmp_path / "background"
    shutil.copytree(background_files()[0].parent, copy)
    assert task_config_key("babilong:1:1k", "train", tokenizer=tokenizer, background_dir=copy) == key
    book = copy / "alice.txt"
    book.write_text(book.read_text().replace("Rabbit", "Hare"))
    assert task_config_key("babilong:1:1k", "train", tokenizer=tokenizer, background_dir=copy) != key
    assert task_config_key("babilong:1:0", "train")["tokenizer"] is None


def test_config_train_and_eval_accept_the_name(tokenizer):
    from ilcp.config import load_config
    from ilcp.evaluation.run import parse_task
    from ilcp.tasks import EvalTaskContext
    from ilcp.training.data import load_rows, task_kwargs

    cfg = load_config(None, ["data.task=babilong:1:1k", "data.babi_variant=en"])
    assert cfg.data.task == "babilong:1:1k"
    for bad in ("babilong:1", "babilong:1:xyz"):
        with pytest.raises(ValueError, match="data.task"):
            load_config(None, [f"data.task={bad}"])
    assert task_kwargs(cfg, "train", 4, tokenizer)["tokenizer"] is tokenizer
    assert "tokenizer" not in task_kwargs(load_config(None, []), "train", 4, tokenizer)
    rows, key = load_rows(cfg, "validation", 4, tokenizer)
    assert len(rows) == 4 and key["task"] == "babilong-qa1-1k" and key["split"] == "validation"

    spec = parse_task("babilong:2:2048")
    assert spec.name == "babilong:2:2k" and spec.parsed.length == 2048 and not spec.needs_facts_settings
    built = spec.eval_rows(3, EvalTaskContext(tokenizer=tokenizer))
    rows, available, source = built.rows, built.available, built.source
    assert len(rows) == 3 and available == 1000 and "2048-token" in source
    assert all(n_tokens(tokenizer, r["context"]) <= 2048 for r in rows)
    # the validation split: the stories the run held out of its training file, in validation background
    held = spec.eval_rows(3, EvalTaskContext(tokenizer=tokenizer, split="validation",
                                             task_settings={"babi_variant": "en", "seed": 0}))
    assert len(held.rows) == 3 and all("-validation-" in r["id"] for r in held.rows)
    assert "validation stories of qa2" in held.source and "validation background" in held.source
    assert held.available == len(load_babi(2, "validation", variant="en"))
    assert not {r["context"] for r in held.rows} & {r["context"] for r in rows}
    for bad in ("babilong:1", "babilong:99:1k"):
        with pytest.raises(ValueError, match="babilong"):
            parse_task(bad)


def test_a_run_trains_and_evaluates_on_a_babilong_task(tmp_path, tiny_lm):
    from ilcp.config import load_config
    from ilcp.evaluation.run import evaluate
    from ilcp.export import read_export
    from ilcp.training import train

    tiny = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    cfg = load_config(tiny, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                             "data.task=babilong:1:0.5k", "handoff.variants=[prompt_tuned]",
                             "handoff.max_steps=1", "handoff.val_every_steps=1",
                             "compressor.answer_head_weight=0", "handoff.finetune_encoder=false"])
    result = train(cfg, lm=tiny_lm)
    assert result.metrics["train_rows"] == cfg.data.train_size
    assert read_export(result.run_dir).config["task"] == "babilong:1:0.5k"
    results = evaluate(result.run_dir, lm=tiny_lm, tasks=["babilong:1:0"], methods=["no_context"], limit=2,
                       latency_n=0, lengths=[], facts_counts=[])
    assert list(results["tasks"]) == ["babilong:1:0.5k", "babilong:1:0"]
    assert results["tasks"]["babilong:1:0.5k"]["seen_in_training"]
    assert not results["tasks"]["babilong:1:0"]["seen_in_training"]


# ------------------------------------------------------------------------- story attention (training)

def test_story_token_mask_marks_exactly_the_story(tokenizer):
    from ilcp.tasks.babilong_context import story_spans, story_token_mask
    from ilcp.tasks import babilong_stories

    rows = load_task("babilong:1:0.5k", "validation", tokenizer=tokenizer, limit=3).to_list()
    stories = babilong_stories("babilong:1:0.5k", "validation", tokenizer=tokenizer, limit=3)
    assert len(stories) == 3
    for row, story in zip(rows, stories):
        spans = story_spans(row["context"], story)
        assert [row["context"][a:b] for a, b in spans] == story
        mask = story_token_mask(row["context"], story, tokenizer)
        ids = tokenizer(row["context"], add_special_tokens=False)["input_ids"]
        assert len(mask) == len(ids) and 0 < sum(mask) < len(mask)
        # the marked tokens decode to the story's words, the others to none of them
        story_text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert " ".join(story_text.split()) == " ".join(" ".join(story).split())
        prose = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
        assert not any(name in prose for name in BABI_NAMES)
    with pytest.raises(ValueError, match="not in the context"):
        story_spans(rows[0]["context"], ["Mary flew to the moon."])


def test_story_attention_loss_prefers_spread_over_the_story():
    import torch

    from ilcp.encoder.pooling import AttentionPooler
    from ilcp.training.compressor_stage import story_attention_loss

    torch.manual_seed(0)
    pooler = AttentionPooler(8, num_queries=2)
    tokens, mask = torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.long)
    story = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    ce, mass = story_attention_loss(pooler, tokens, mask, story)  # an untrained pooler: uniform
    assert mass.item() == pytest.approx(2 / 6) and ce.item() == pytest.approx(float(torch.tensor(6.0).log()))
    opt = torch.optim.Adam(pooler.parameters(), lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        story_attention_loss(pooler, tokens, mask, story)[0].backward()
        opt.step()
    ce, mass = story_attention_loss(pooler, tokens, mask, story)
    w = pooler.weights(tokens[:1], mask[:1])[0]
    assert mass.item() > 0.9 and abs(w[1] - w[2]).max().item() < 0.2  # on the story, spread over it
    none = story_attention_loss(pooler, tokens[1:], mask[1:], story[1:])
    assert none[0].item() == 0.0 and none[0].requires_grad


def test_story_attention_needs_a_babilong_task_and_attention_pooling():
    from ilcp.config import load_config

    with pytest.raises(ValueError, match="needs a BABILong task"):
        load_config(None, ["compressor.story_attention_weight=1"])
    with pytest.raises(ValueError, match="memory.kind=attention without chunks"):
        load_config(None, ["data.task=babilong:1:1k", "compressor.story_attention_weight=1", "compressor.memory.kind=mean"])
    with pytest.raises(ValueError, match=">= 0"):
        load_config(None, ["compressor.pooler_lr=-1"])


def test_a_run_learns_where_the_story_is(tmp_path, tiny_lm):
    from ilcp.config import load_config
    from ilcp.training import train

    tiny = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    cfg = load_config(tiny, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                             "data.task=babilong:1:0.5k", "data.babi_variant=en", "handoff.variants=[ilcp]",
                             "handoff.max_steps=1", "handoff.val_every_steps=1", "compressor.epochs=40",
                             "compressor.story_attention_weight=1", "compressor.pooler_lr=0.05"])
    result = train(cfg, lm=tiny_lm)
    mass = result.metrics["compressor"]["val/story_mass"]
    # an untrained pooler reads every token alike: its mass on the story is the story's share
    from ilcp.tasks.babilong_context import story_token_mask
    from ilcp.tasks import babilong_stories

    rows = load_task("babilong:1:0.5k", "validation", tokenizer=tiny_lm.tokenizer, variant="en", limit=8)
    stories = babilong_stories("babilong:1:0.5k", "validation", variant="en", limit=8)
    masks = [story_token_mask(r["context"], s, tiny_lm.tokenizer) for r, s in zip(rows, stories)]
    share = sum(sum(m) / len(m) for m in masks) / len(masks)
    assert mass > 4 * share, (share, mass)


# ----------------------------------------------------------------------------------------- mixes

def test_a_mix_names_its_tasks_sorted():
    task = parse_babilong_name("babilong:8+qa1:0.5k")
    assert task == (1, 512, "babilong-qa1+qa8-0.5k", (1, 8))
    assert task.parts == ["babilong:1:0.5k", "babilong:8:0.5k"]
    assert parse_babilong_name("babilong:2:1k").numbers == (2,) and parse_babilong_name("babilong:2:1k").parts == ["babilong:2:1k"]
    with pytest.raises(ValueError, match="listed twice"):
        parse_babilong_name("babilong:1+1:1k")
    with pytest.raises(ValueError, match="needs a length: 'babilong:1\\+8:<length>'"):
        parse_babilong_name("babilong:1+8")


def test_a_mix_interleaves_each_tasks_own_rows(tokenizer):
    from ilcp.tasks.babilong_context import story_token_mask
    from ilcp.tasks import babilong_stories

    kwargs = {"tokenizer": tokenizer, "variant": "en"}
    mix = load_task("babilong:1+8:0.5k", "train", limit=6, **kwargs)
    ones = load_task("babilong:1:0.5k", "train", limit=3, **kwargs)
    eights = load_task("babilong:8:0.5k", "train", limit=3, **kwargs)
    # the tasks alternate in proportion to their sizes; each row is its own task's row, unchanged
    by_id = {r["id"]: r for r in [*ones, *eights]}
    assert sorted(mix["id"]) == sorted(by_id) and [r["task"] for r in mix][:2] == ["babilong-qa1-0.5k", "babilong-qa8-0.5k"]
    assert all(by_id[r["id"]] == r for r in mix)
    assert load_task("babilong:1+8:0.5k", "train", limit=4, **kwargs)["id"] == mix["id"][:4]
    # the stories line up with the rows, so story attention's mask marks each row's own story
    stories = babilong_stories("babilong:1+8:0.5k", "train", limit=6, variant="en")
    for row, story in zip(mix, stories):
        story_positions(row["context"], story)
        assert 0 < sum(story_token_mask(row["context"], story, tokenizer)) < n_tokens(tokenizer, row["context"])


def test_a_mix_key_lists_its_tasks_and_eval_reads_them_one_by_one(tokenizer):
    from ilcp.config import load_config
    from ilcp.evaluation.run import parse_task
    from ilcp.evaluation.session import training_tasks

    key = task_config_key("babilong:1+8:0.5k", "train", tokenizer=tokenizer, variant="en", limit=6)
    assert key["task"] == "babilong-qa1+qa8-0.5k" and key["limit"] == 6
    assert [p["task"] for p in key["parts"]] == ["babilong-qa1-0.5k", "babilong-qa8-0.5k"]
    assert key["parts"][1]["source"] == "qa8_lists-sets_train.txt"
    assert task_config_key("babilong:1+7:0.5k", "train", tokenizer=tokenizer, variant="en", limit=6) != key
    assert load_config(None, ["data.task=babilong:1+8:0.5k"]).data.task == "babilong:1+8:0.5k"
    assert [s.name for s in training_tasks("babilong:1+8:0.5k")] == ["babilong:1:0.5k", "babilong:8:0.5k"]
    assert [s.name for s in parse_task("babilong:1+8:2k").parts()] == ["babilong:1:2k", "babilong:8:2k"]
    with pytest.raises(ValueError, match="qa99|99"):
        load_task("babilong:1+99:0.5k", "train", tokenizer=tokenizer, variant="en")


def test_a_run_trains_on_a_mix_with_story_attention_and_eval_reads_each_task(tmp_path, tiny_lm):
    from ilcp.config import load_config
    from ilcp.evaluation.run import evaluate
    from ilcp.training import train

    tiny = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    cfg = load_config(tiny, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                             "data.task=babilong:1+8:0.5k", "data.babi_variant=en", "handoff.variants=[ilcp]",
                             "handoff.max_steps=1", "handoff.val_every_steps=1", "compressor.epochs=2",
                             "compressor.story_attention_weight=1"])
    result = train(cfg, lm=tiny_lm)
    assert result.metrics["train_rows"] == cfg.data.train_size
    assert 0.0 <= result.metrics["compressor"]["val/story_mass"] <= 1.0
    results = evaluate(result.run_dir, lm=tiny_lm, tasks=["babilong:2:0.5k"], methods=["no_context"], limit=2,
                       latency_n=0, lengths=[], facts_counts=[])
    assert list(results["tasks"]) == ["babilong:1:0.5k", "babilong:8:0.5k", "babilong:2:0.5k"]
    assert [t["seen_in_training"] for t in results["tasks"].values()] == [True, True, False]

"""ilcp.tasks.background: the public-domain books BABILong contexts hide bAbI stories in, their
sentences (none that could pass for a bAbI fact) and each split's own passages."""

import re

import pytest

from ilcp.tasks import load_babi
from ilcp.tasks.babilong_context import babilong_context, story_sentences
from ilcp.tasks.background import BABI_NAMES, background_files, background_sentences, is_babi_like, split_sentences

SPLITS = ("train", "validation", "test")


@pytest.fixture(scope="module")
def tokenizer(tiny_lm):
    return tiny_lm.tokenizer


def test_background_ships_with_its_licence():
    files = background_files()
    assert [p.name for p in files] == ["alice.txt", "botchan.txt"]
    assert sum(p.stat().st_size for p in files) < 4_000_000
    readme = (files[0].parent / "README.md").read_text()
    assert "public domain" in readme and all(p.name in readme for p in files)
    for path in files:
        assert "gutenberg" not in path.read_text().lower()  # header, footer and licence removed


def test_splits_read_disjoint_contiguous_passages():
    by_split = {split: background_sentences(split) for split in SPLITS}
    places = {split: {(s.source, s.index) for s in sentences} for split, sentences in by_split.items()}
    assert not places["train"] & places["validation"]
    assert not places["train"] & places["test"]
    assert not places["validation"] & places["test"]
    for source in ("alice.txt", "botchan.txt"):  # each book: train, then validation, then test
        ranges = [sorted(i for s, i in places[split] if s == source) for split in SPLITS]
        assert all(r == list(range(r[0], r[-1] + 1)) for r in ranges)
        assert ranges[0][0] == 0 and ranges[0][-1] + 1 == ranges[1][0] and ranges[1][-1] + 1 == ranges[2][0]
        sizes = [len(r) for r in ranges]
        assert sizes[0] > 7 * sizes[1] and abs(sizes[1] - sizes[2]) <= 1
    # long sentences do not repeat, so no text is shared either
    texts = {split: {s.text for s in sentences if len(s.text.split()) >= 8}
             for split, sentences in by_split.items()}
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]
    assert not texts["validation"] & texts["test"]


def test_contexts_read_only_their_splits_background(tokenizer):
    texts = {split: {s.text for s in background_sentences(split) if len(s.text.split()) >= 8}
             for split in SPLITS}
    story = story_sentences(load_babi(1, "test")[0]["context"])
    for split in SPLITS:
        others = set().union(*(texts[s] for s in SPLITS if s != split)) - texts[split]
        for seed in range(3):
            context = babilong_context(story, 1024, tokenizer, split=split, seed=seed)
            used = [t for t in texts[split] if t in context]
            assert len(used) >= 5
            assert not [t for t in others if t in context]


def test_background_is_not_babi_like():
    for split in SPLITS:
        for sentence in background_sentences(split):
            assert not is_babi_like(sentence.text), sentence
            assert not set(re.findall(r"[A-Za-z]+", sentence.text)) & BABI_NAMES, sentence
            assert not re.fullmatch(r"\w+ (went|moved|journeyed|travelled) (back )?to the \w+\.",
                                    sentence.text), sentence
            assert 5 <= len(sentence.text.split()) <= 48


def test_the_detector_flags_babi_statements():
    for task in (1, 2, 3):
        statements = {s for row in load_babi(task, "test", limit=300)["context"] for s in story_sentences(row)}
        assert statements and all(is_babi_like(s) for s in statements)
    for sentence in ("Mary went to the kitchen.", "She went to the garden.", "The cat moved to the hallway.",
                     "I went to the school.", "He took the apple there.", "Fred is in the office.",
                     "Lucas is no longer in the park.", "They journeyed back to the bedroom."):
        assert is_babi_like(sentence), sentence
    for sentence in ("Alice was beginning to get very tired of sitting by her sister on the bank.",
                     ("I went to the school, and after a long while a teacher I had never seen came in "
                      "and talked for an hour about nothing at all."),
                     "'A likely story indeed!' said the Pigeon in a tone of the deepest contempt."):
        assert not is_babi_like(sentence), sentence


def test_sentences_split_at_ends_outside_quotes():
    assert split_sentences(
        "Mr. K. Natsume wrote it. 'Oh dear! I shall be late!' (she thought) and ran. "
        "\"Hello, Kiyo, I'm back!\" \"How good of you!\" she cried. Isn't it?") == [
        "Mr. K. Natsume wrote it.", "'Oh dear! I shall be late!' (she thought) and ran.",
        "\"Hello, Kiyo, I'm back!\"", "\"How good of you!\" she cried.", "Isn't it?"]

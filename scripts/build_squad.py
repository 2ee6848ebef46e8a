"""Build the small SQuAD v1.1 subset shipped under data/squad from the SQuAD v1.1 training set.

Two sources hold the same data; give exactly one:

``--explorer DIR``
    A folder of the SQuAD authors' explorer pages for the v1.1 training set, one HTML page per
    article (``explore/1.1/train/*.html`` of https://github.com/rajpurkar/SQuAD-explorer; the
    pages are in its gh-pages history, commit 13f82e35b9a1fb9173f863b35f5675030646571e, and were
    removed from the branch in the next update). Each page shows every paragraph of one article
    (``<pre>`` inside ``div.para-wrap``) and, for each paragraph, its questions
    (``strong.question``) and answers (``span.answer``). Pages without an ``h1#title`` (the
    folder's ``index.html``) are skipped. Export the pages with, for example::

        G=<git dir of rajpurkar/SQuAD-explorer>; C=13f82e35b9a1fb9173f863b35f5675030646571e
        mkdir -p /tmp/squad/explorer-train
        git --git-dir=$G archive $C explore/1.1/train | tar -x -C /tmp/squad/explorer-train --strip-components=3

``--source FILE``
    The official ``train-v1.1.json`` (https://rajpurkar.github.io/SQuAD-explorer/dataset/train-v1.1.json,
    30,288,272 bytes, sha256 3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955,
    442 articles, 87,599 questions). Any other file is refused unless ``--allow-unofficial`` is
    given (meant for testing the script on a small fixture; never for the shipped data).

Both sources are read into the same form (article title as the explorer page shows it, i.e. the
JSON title URL-decoded; paragraphs and questions in file order; answer texts), so the official
file and the pages give the same output files when they hold the same data.

Recipe (deterministic for a given source, seed and Python's ``random`` module):

1. The article titles are sorted, then shuffled with ``random.Random(seed)``.
2. Articles are dealt in that order to test first, then validation, then train. From each article
   at most ``--paragraphs`` paragraphs are drawn with the same generator (``rng.sample`` over the
   paragraph indices, kept in page order), and every question of those paragraphs is taken,
   except questions with an answer text (surrounding whitespace stripped) that does not occur in
   the paragraph; those are skipped and counted.
3. A split stops taking articles as soon as its question count reaches its target
   (``--test``/``--validation``/``--train``, default 500/300/3000); the exact counts are what the
   recipe yields and are printed. An article therefore belongs to exactly one split.

Each output line is one JSON object with the fields ``id`` (``squad-<ascii title>-p<P>-q<Q>``,
P the paragraph's 0-based index in its article, Q the question's 0-based index in its paragraph;
SQuAD's own question ids are not on the explorer pages), ``title``, ``context`` (the paragraph),
``question`` and ``answer`` (every distinct answer text, in page order). The script writes
``train.jsonl``, ``validation.jsonl``, ``test.jsonl``, ``SOURCE.md``, ``README.md`` and
``LICENSE.txt`` into ``--out``, each through a temporary file and ``os.replace``; re-running it on
the same source gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import sys
import tempfile
import unicodedata
from pathlib import Path

from squad_sources import load_explorer, load_json, totals

OFFICIAL_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset/train-v1.1.json"
OFFICIAL_SHA256 = "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955"
OFFICIAL_SIZE = 30_288_272
OFFICIAL_ARTICLES = 442
OFFICIAL_QUESTIONS = 87_599
EXPLORER_REPO = "https://github.com/rajpurkar/SQuAD-explorer"
EXPLORER_PATH = "explore/1.1/train/"
LICENSE_URL = "https://creativecommons.org/licenses/by-sa/4.0/legalcode"
CITATION = (
    'Pranav Rajpurkar, Jian Zhang, Konstantin Lopyrev, Percy Liang. "SQuAD: 100,000+ Questions '
    'for Machine Comprehension of Text". EMNLP 2016, pages 2383-2392. arXiv:1606.05250.'
)
SPLITS = ("test", "validation", "train")  # the order in which articles are dealt
SLUG_MAX = 40


# ----------------------------------------------------------------------------- the recipe

def slug(title: str) -> str:
    """A short ASCII form of a title for ids: accents and apostrophes dropped, other runs of
    non-alphanumeric characters turned into one '_', at most SLUG_MAX characters."""
    decomposed = unicodedata.normalize("NFKD", title)
    letters = "".join(c for c in decomposed if not unicodedata.combining(c) and c not in "'’")
    return re.sub(r"[^A-Za-z0-9]+", "_", letters).strip("_")[:SLUG_MAX].rstrip("_")


def distinct(texts: list[str]) -> list[str]:
    seen: list[str] = []
    for text in texts:
        text = text.strip()
        if text not in seen:
            seen.append(text)
    return seen


def build_splits(articles: list[dict], targets: dict[str, int], paragraphs: int, seed: int):
    """Deal articles to the splits.

    Returns {split: [record, ...]}, {split: [title, ...]}, {split: paragraph count} and
    {split: [(id, reason), ...]} for the questions that were skipped.
    """
    by_title = {article["title"]: article for article in articles}
    if len(by_title) != len(articles):
        raise ValueError("article titles are not unique in the source")
    slugs = {slug(title) for title in by_title}
    if len(slugs) != len(by_title) or "" in slugs:
        raise ValueError("the ASCII forms of the article titles are not unique")
    rng = random.Random(seed)
    titles = sorted(by_title)
    rng.shuffle(titles)

    records: dict[str, list[dict]] = {split: [] for split in SPLITS}
    taken: dict[str, list[str]] = {split: [] for split in SPLITS}
    paragraph_counts = {split: 0 for split in SPLITS}
    skipped: dict[str, list[tuple[str, str]]] = {split: [] for split in SPLITS}
    order = iter(SPLITS)
    split = next(order)
    for title in titles:
        article = by_title[title]
        n = len(article["paragraphs"])
        chosen = sorted(rng.sample(range(n), min(paragraphs, n)))
        for p in chosen:
            paragraph = article["paragraphs"][p]
            context = paragraph["context"]
            for q, qa in enumerate(paragraph["qas"]):
                qid = f"squad-{slug(title)}-p{p}-q{q}"
                answers = distinct(qa["answers"])
                if not answers or not all(answers):
                    skipped[split].append((qid, "empty answer"))
                    continue
                if not all(text in context for text in answers):
                    skipped[split].append((qid, "answer not in its paragraph"))
                    continue
                records[split].append({
                    "id": qid,
                    "title": title,
                    "context": context,
                    "question": qa["question"].strip(),
                    "answer": answers,
                })
        paragraph_counts[split] += len(chosen)
        taken[split].append(title)
        if len(records[split]) >= targets[split]:
            split = next(order, None)
            if split is None:
                break
    if split is not None:
        raise ValueError(f"the source ran out of articles before the {split} split reached its target")
    return records, taken, paragraph_counts, skipped


def check(records: dict[str, list[dict]], taken: dict[str, list[str]]) -> dict[str, int]:
    """The invariants the shipped files promise."""
    seen_titles: dict[str, str] = {}
    seen_ids: set[str] = set()
    for split in SPLITS:
        for title in taken[split]:
            assert title not in seen_titles, f"article {title!r} is in {seen_titles[title]} and {split}"
            seen_titles[title] = split
        for record in records[split]:
            assert record["title"] in taken[split], record["id"]
            assert record["id"].isascii(), record["id"]
            assert record["id"] not in seen_ids, f"question id {record['id']} twice"
            seen_ids.add(record["id"])
            assert record["question"] and record["question"] == record["question"].strip(), record["id"]
            assert record["answer"], f"{record['id']}: empty answer list"
            for text in record["answer"]:
                assert text and text == text.strip(), f"{record['id']}: answer {text!r}"
                assert text in record["context"], f"{record['id']}: answer {text!r} not in its context"
    return {"questions": len(seen_ids), "articles": len(seen_titles)}


# ----------------------------------------------------------------------------- writing

def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def jsonl(records: list[dict]) -> str:
    keys = ("id", "title", "context", "question", "answer")
    return "".join(json.dumps({k: r[k] for k in keys}, ensure_ascii=False) + "\n" for r in records)


def counts_table(stats: dict[str, dict[str, int]], sizes: dict[str, int]) -> str:
    rows = ["| split | questions | paragraphs | articles | bytes |", "|---|---:|---:|---:|---:|"]
    for split in ("train", "validation", "test"):
        s = stats[split]
        rows.append(f"| {split} | {s['questions']:,} | {s['paragraphs']:,} | {s['articles']:,} | {sizes[split]:,} |")
    return "\n".join(rows)


def source_md(args, command: str, facts: dict, whole: dict, stats, sizes, skipped) -> str:
    if args.explorer is not None:
        origin = f"""- Text: the SQuAD v1.1 **training** set as its authors published it in the SQuAD explorer,
  one HTML page per article: repository {EXPLORER_REPO}, path `{EXPLORER_PATH}`
  ({facts['pages']} pages: {whole['articles']} articles and {', '.join(facts['not_articles']) or 'nothing else'}).
  The pages are in the history of the repository's gh-pages branch (added in commit 13f82e35,
  2016-08-24; removed in the next update, c4f8d268, 2016-08-28).
- Commit the pages were read from: `{args.explorer_commit or '(not recorded)'}`
- sha256 over the pages (`LC_ALL=C sha256sum *.html | sha256sum`):
  `{facts['pages_sha256']}`
- Read from the pages: {whole['articles']:,} articles, {whole['paragraphs']:,} paragraphs,
  {whole['questions']:,} questions, {whole['answers']:,} answers.
- The official `train-v1.1.json` ({OFFICIAL_URL},
  sha256 `{OFFICIAL_SHA256}`) has {OFFICIAL_ARTICLES} articles and {OFFICIAL_QUESTIONS:,}
  questions. It is the same data, but it could not be downloaded where this folder was built, so
  the pages were used. The pages do not show SQuAD's question ids or answer offsets; the `id`
  field is derived (see README.md)."""
    else:
        origin = f"""- Text: the official SQuAD v1.1 training file `train-v1.1.json` ({OFFICIAL_URL}).
- Where this copy was obtained: {args.obtained_from or "(not recorded)"}
- sha256 of the copy: `{facts['sha256']}` (official: `{OFFICIAL_SHA256}`), {facts['size']:,} bytes
- Read from the file: {whole['articles']:,} articles, {whole['paragraphs']:,} paragraphs,
  {whole['questions']:,} questions, {whole['answers']:,} answers."""
    n_skipped = sum(len(v) for v in skipped.values())
    listing = "".join(f"\n  - {split}: `{qid}` ({why})" for split in SPLITS for qid, why in skipped[split])
    return f"""# Source of data/squad

{origin}
- Licence: CC BY-SA 4.0 ({LICENSE_URL}); see LICENSE.txt.

The source is not part of this repository.

## Command that built this folder

```
{command}
```

Seed {args.seed}, at most {args.paragraphs} paragraphs per article, targets
test {args.test} / validation {args.validation} / train {args.train} questions.

## Result

{counts_table(stats, sizes)}

Questions skipped (an answer text not found in the paragraph): {n_skipped}{listing}
"""


def readme_md(args, stats, sizes) -> str:
    return f"""# SQuAD v1.1 subset (split by article)

A small subset of the SQuAD v1.1 **training** set (Rajpurkar et al. 2016), re-split into
train / validation / test **by Wikipedia article**: no article appears in two splits. The official
dev set is not used. Built by `scripts/build_squad.py`; SOURCE.md says from what and with which
command. Licence: CC BY-SA 4.0 (LICENSE.txt).

## Files

- `train.jsonl`, `validation.jsonl`, `test.jsonl`: one JSON object per line (UTF-8).
- `SOURCE.md`: where the text came from, the build command and the counts.
- `LICENSE.txt`: the licence (CC BY-SA 4.0) and the citation.

## Fields

| field | meaning |
|---|---|
| `id` | `squad-<title in ASCII, at most {SLUG_MAX} characters>-p<P>-q<Q>`: P is the paragraph's 0-based index in its article, Q the question's 0-based index in its paragraph (derived; not SQuAD's question id) |
| `title` | the article's title as the SQuAD explorer shows it (underscores for spaces) |
| `context` | the paragraph |
| `question` | the question (surrounding whitespace stripped) |
| `answer` | list of every distinct answer text, in source order (one in the training set), surrounding whitespace stripped; each occurs in `context` |

## Recipe

1. Sort the article titles and shuffle them with `random.Random({args.seed})`.
2. Deal the articles in that order to test, then validation, then train. From each article take
   at most {args.paragraphs} paragraphs (drawn with the same generator, kept in page order) and
   every question of those paragraphs whose answers occur in the paragraph.
3. A split stops taking articles once it has at least its target of questions
   (test {args.test}, validation {args.validation}, train {args.train}).

## Counts

{counts_table(stats, sizes)}
"""


def license_txt() -> str:
    return f"""SQuAD (the Stanford Question Answering Dataset) is distributed by its authors under the
Creative Commons Attribution-ShareAlike 4.0 International licence (CC BY-SA 4.0):
{LICENSE_URL}

The files in this folder are a derivative of the SQuAD v1.1 training set (a selection of its
paragraphs, questions and answers, re-split and re-formatted by scripts/build_squad.py) and are
distributed under the same licence, CC BY-SA 4.0.

Changes made: a subset of articles and paragraphs was selected, the articles were re-split into
train / validation / test, and each question was written as one JSON line with its paragraph and
its distinct answer texts (whitespace around questions and answers stripped, answer offsets and
SQuAD's question ids not kept, new ids derived from title and position).

Please cite:
{CITATION}
"""


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--explorer", type=Path, help="folder of the explorer pages explore/1.1/train/*.html")
    source.add_argument("--source", type=Path, help="the official train-v1.1.json")
    parser.add_argument("--out", required=True, type=Path, help="output folder (e.g. data/squad)")
    parser.add_argument("--explorer-commit", default="",
                        help="commit of rajpurkar/SQuAD-explorer the pages came from (goes into SOURCE.md)")
    parser.add_argument("--obtained-from", default="",
                        help="with --source: where this copy of the file came from (goes into SOURCE.md)")
    parser.add_argument("--allow-unofficial", action="store_true",
                        help="with --source: accept a file that is not the official one (tests of this script only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random.Random (default 0)")
    parser.add_argument("--paragraphs", type=int, default=2, help="at most this many paragraphs per article (default 2)")
    parser.add_argument("--test", type=int, default=500, help="question target of the test split (default 500)")
    parser.add_argument("--validation", type=int, default=300, help="question target of the validation split (default 300)")
    parser.add_argument("--train", type=int, default=3000, help="question target of the train split (default 3000)")
    args = parser.parse_args(argv)

    if args.explorer is not None:
        articles, facts = load_explorer(args.explorer)
        whole = totals(articles)
        print(f"explorer pages: {facts['pages']} files in {args.explorer}; not articles: "
              f"{', '.join(facts['not_articles']) or 'none'}")
        print(f"read: {whole['articles']:,} articles, {whole['paragraphs']:,} paragraphs, "
              f"{whole['questions']:,} questions, {whole['answers']:,} answers "
              f"(official train-v1.1.json: {OFFICIAL_ARTICLES} articles, {OFFICIAL_QUESTIONS:,} questions)")
        if (whole["articles"], whole["questions"]) != (OFFICIAL_ARTICLES, OFFICIAL_QUESTIONS):
            print("warning: the pages do not hold as many articles / questions as the official file",
                  file=sys.stderr)
    else:
        articles, facts = load_json(args.source)
        whole = totals(articles)
        print(f"source: {args.source} ({facts['size']:,} bytes), sha256 {facts['sha256']}")
        print(f"read: version {facts['version']!r}, {whole['articles']:,} articles, "
              f"{whole['paragraphs']:,} paragraphs, {whole['questions']:,} questions")
        official = (facts["sha256"] == OFFICIAL_SHA256 and facts["version"] == "1.1"
                    and whole["articles"] == OFFICIAL_ARTICLES and whole["questions"] == OFFICIAL_QUESTIONS)
        if not official:
            if not args.allow_unofficial:
                print("error: the source is not the official SQuAD v1.1 train-v1.1.json "
                      f"(expected sha256 {OFFICIAL_SHA256}, {OFFICIAL_ARTICLES} articles, "
                      f"{OFFICIAL_QUESTIONS} questions)", file=sys.stderr)
                return 2
            print("warning: the source is NOT the official file (--allow-unofficial)", file=sys.stderr)

    targets = {"test": args.test, "validation": args.validation, "train": args.train}
    records, taken, paragraph_counts, skipped = build_splits(articles, targets, args.paragraphs, args.seed)
    checked = check(records, taken)
    stats = {split: {"questions": len(records[split]), "paragraphs": paragraph_counts[split],
                     "articles": len(taken[split])} for split in SPLITS}

    texts = {split: jsonl(records[split]) for split in SPLITS}
    sizes = {split: len(texts[split].encode("utf-8")) for split in SPLITS}
    for split in SPLITS:
        write_atomic(args.out / f"{split}.jsonl", texts[split])
    command = "python scripts/build_squad.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    write_atomic(args.out / "SOURCE.md", source_md(args, command, facts, whole, stats, sizes, skipped))
    write_atomic(args.out / "README.md", readme_md(args, stats, sizes))
    write_atomic(args.out / "LICENSE.txt", license_txt())

    for split in ("train", "validation", "test"):
        s = stats[split]
        print(f"{split}: {s['questions']} questions, {s['paragraphs']} paragraphs, {s['articles']} articles, "
              f"{sizes[split]:,} bytes, {len(skipped[split])} questions skipped")
        for qid, why in skipped[split]:
            print(f"  skipped {qid}: {why}")
    print(f"total: {checked['questions']} questions, {checked['articles']} articles; no article in two splits")
    return 0


if __name__ == "__main__":
    sys.exit(main())

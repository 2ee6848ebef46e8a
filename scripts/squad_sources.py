"""The two sources of the SQuAD v1.1 training set that scripts/build_squad.py reads, each into the
same form: articles ``{"title", "paragraphs"}``, each paragraph ``{"context", "qas"}`` and each
question ``{"question", "answers"}`` (answer texts), in file order; the explorer's HTML pages
(`ExplorerPage`, `load_explorer`) or the official train-v1.1.json (`load_json`).
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import urllib.parse
from pathlib import Path


class ExplorerPage(html.parser.HTMLParser):
    """Collects the title, paragraphs, questions and answers of one explorer article page.

    ``self.title`` is the text of ``h1#title`` (None on a page without one) and
    ``self.paragraphs`` a list of ``{"context": str, "qas": [{"question": str, "answers": [str]}]}``
    in page order. Character references are resolved by the parser (``convert_charrefs``).
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title: str | None = None
        self.paragraphs: list[dict] = []
        self._field: str | None = None  # what the text being read belongs to
        self._end: str | None = None    # the tag that ends it
        self._text: list[str] = []

    def _start_field(self, field: str, tag: str) -> None:
        self._field, self._end, self._text = field, tag, []

    def handle_starttag(self, tag, attrs):
        if self._field is not None:
            raise ValueError(f"unexpected <{tag}> inside the {self._field} at line {self.getpos()[0]}")
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "h1" and attrs.get("id") == "title":
            self._start_field("title", "h1")
        elif tag == "div" and "para-wrap" in classes:
            self.paragraphs.append({"context": None, "qas": []})
        elif tag == "pre":
            self._paragraph("<pre>")
            self._start_field("context", "pre")
        elif tag == "strong" and "question" in classes:
            self._paragraph("a question")
            self._start_field("question", "strong")
        elif tag == "span" and "answer" in classes:
            paragraph = self._paragraph("an answer")
            if not paragraph["qas"]:
                raise ValueError(f"an answer before any question at line {self.getpos()[0]}")
            self._start_field("answer", "span")

    def _paragraph(self, what: str) -> dict:
        if not self.paragraphs:
            raise ValueError(f"{what} outside any div.para-wrap at line {self.getpos()[0]}")
        return self.paragraphs[-1]

    def handle_data(self, data):
        if self._field is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if self._field is None or tag != self._end:
            return
        text = "".join(self._text)
        field, self._field, self._end, self._text = self._field, None, None, []
        if field == "title":
            if self.title is not None:
                raise ValueError("two h1#title on one page")
            self.title = text
        elif field == "context":
            paragraph = self.paragraphs[-1]
            if paragraph["context"] is not None:
                raise ValueError(f"two <pre> in one paragraph at line {self.getpos()[0]}")
            paragraph["context"] = text
        elif field == "question":
            self.paragraphs[-1]["qas"].append({"question": text, "answers": []})
        else:
            self.paragraphs[-1]["qas"][-1]["answers"].append(text)


def load_explorer(folder: Path) -> tuple[list[dict], dict]:
    """Articles ``{"title", "paragraphs"}`` from a folder of explorer pages, and facts about it."""
    pages = sorted(p for p in folder.iterdir() if p.suffix == ".html")
    if not pages:
        raise ValueError(f"no .html pages in {folder}")
    articles, skipped = [], []
    manifest = hashlib.sha256()
    for page in pages:
        raw = page.read_bytes()
        manifest.update(f"{hashlib.sha256(raw).hexdigest()}  {page.name}\n".encode("utf-8"))
        parser = ExplorerPage()
        parser.feed(raw.decode("utf-8"))
        parser.close()
        if parser.title is None:
            if parser.paragraphs:
                raise ValueError(f"{page.name}: paragraphs but no h1#title")
            skipped.append(page.name)
            continue
        for index, paragraph in enumerate(parser.paragraphs):
            if paragraph["context"] is None:
                raise ValueError(f"{page.name}: paragraph {index} has no <pre>")
        articles.append({"title": parser.title, "paragraphs": parser.paragraphs, "file": page.name})
    facts = {"pages": len(pages), "not_articles": skipped, "pages_sha256": manifest.hexdigest()}
    return articles, facts


def load_json(path: Path) -> tuple[list[dict], dict]:
    """Articles from train-v1.1.json, in the same form as ``load_explorer`` gives."""
    with path.open(encoding="utf-8") as stream:
        raw = json.load(stream)
    articles = [{
        "title": urllib.parse.unquote(article["title"]),  # the explorer shows decodeURIComponent(title)
        "paragraphs": [{
            "context": paragraph["context"],
            "qas": [{"question": qa["question"], "answers": [a["text"] for a in qa["answers"]]}
                    for qa in paragraph["qas"]],
        } for paragraph in article["paragraphs"]],
    } for article in raw["data"]]
    facts = {"version": raw.get("version"), "sha256": sha256_of(path), "size": path.stat().st_size}
    return articles, facts


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def totals(articles: list[dict]) -> dict[str, int]:
    return {
        "articles": len(articles),
        "paragraphs": sum(len(a["paragraphs"]) for a in articles),
        "questions": sum(len(p["qas"]) for a in articles for p in a["paragraphs"]),
        "answers": sum(len(q["answers"]) for a in articles for p in a["paragraphs"] for q in p["qas"]),
    }

"""Answer metrics shared by training validation and eval.py.

- exact match: the prediction's first line, normalised, equals the normalised answer;
- contains: the normalised answer occurs as whole words in the normalised first line;
- F1: SQuAD token F1 from torchmetrics (same normalisation: lower case, no punctuation or articles).

Normalisation lower-cases, drops punctuation and the articles a/an/the, and squeezes whitespace,
so "The kitchen." matches "kitchen". bAbI list answers ("apple,football") compare as words.
"""

from __future__ import annotations

import re
import string

from torchmetrics.functional.text import squad

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answer: str) -> bool:
    return normalize_answer(first_line(prediction)) == normalize_answer(answer)


def contains_answer(prediction: str, answer: str) -> bool:
    pred, ans = normalize_answer(first_line(prediction)), normalize_answer(answer)
    return bool(ans) and f" {ans} " in f" {pred} "


def token_f1(predictions: list[str], answers: list[str]) -> list[float]:
    """Per-example SQuAD F1 in [0, 1] (torchmetrics), on the first line of each prediction."""
    out = []
    for i, (p, a) in enumerate(zip(predictions, answers, strict=True)):
        preds = {"prediction_text": first_line(p).replace(",", " "), "id": str(i)}
        target = {"answers": {"answer_start": [0], "text": [a.replace(",", " ")]}, "id": str(i)}
        out.append(float(squad(preds, target)["f1"]) / 100.0)
    return out

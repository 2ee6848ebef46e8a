"""Answer metrics shared by training validation and eval.py.

- exact match: the prediction's first line, normalised, equals the normalised answer;
- contains: the normalised answer occurs as whole words in the normalised first line;
- F1: SQuAD token F1 from torchmetrics (same normalisation: lower case, no punctuation or articles).

Normalisation lower-cases, drops punctuation and the articles a/an/the, and squeezes whitespace,
so "The kitchen." matches "kitchen". bAbI list answers ("apple,football") compare as words.

An answer is one string or a list of accepted answers; a prediction scores its best match. Tasks
with open-text answers (SQuAD, a user's files) are scored as SQuAD scores them (`squad_scores`):
exact match and F1 from ``torchmetrics``' SQuAD metric, the official answer normalisation, the
maximum over the accepted answers.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

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


def accepted(answer: str | Sequence[str]) -> list[str]:
    """The accepted answers of a row's ``answer`` (one string) or ``answers`` (a list)."""
    return [answer] if isinstance(answer, str) else list(answer)


def exact_match(prediction: str, answer: str | Sequence[str]) -> bool:
    pred = normalize_answer(first_line(prediction))
    return any(pred == normalize_answer(a) for a in accepted(answer))


def contains_answer(prediction: str, answer: str | Sequence[str]) -> bool:
    pred = f" {normalize_answer(first_line(prediction))} "
    return any((ans := normalize_answer(a)) and f" {ans} " in pred for a in accepted(answer))


def squad_scores(prediction: str, answer: str | Sequence[str], *, lists: bool = False) -> tuple[float, float]:
    """(exact match, F1), each in [0, 1], of the prediction's first line against the accepted
    answers, by torchmetrics' SQuAD metric (the official normalisation and the maximum over
    answers). ``lists``: commas separate words (bAbI's "apple,football")."""
    def text(t: str) -> str:
        return t.replace(",", " ") if lists else t

    answers = [text(a) for a in accepted(answer)]
    scores = squad({"prediction_text": text(first_line(prediction)), "id": "0"},
                   {"answers": {"answer_start": [0] * len(answers), "text": answers}, "id": "0"})
    return float(scores["exact_match"]) / 100.0, float(scores["f1"]) / 100.0


def token_f1(predictions: list[str], answers: list[str | Sequence[str]], *, open_text: bool = False) -> list[float]:
    """Per-example SQuAD F1 in [0, 1] (torchmetrics), on the first line of each prediction."""
    return [squad_scores(p, a, lists=not open_text)[1] for p, a in zip(predictions, answers, strict=True)]

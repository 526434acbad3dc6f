"""The demo's bundled persona (Mara Lindqvist's notes and chats) and the questions that check what was learned."""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from importlib import resources

from lorad.client.samples import parse_jsonl
from lorad.client.types import Sample

PERSONA = "Mara Lindqvist"
_PACKAGE = "lorad.client"
_DATA_DIR = "demo_data"


@dataclass(frozen=True)
class Question:
    """A question about the persona and the facts a good answer mentions (any one of them counts)."""

    question: str
    facts: tuple[str, ...]


def _read(name: str) -> str:
    return resources.files(_PACKAGE).joinpath(_DATA_DIR, name).read_text(encoding="utf-8")


def load_samples() -> list[Sample]:
    """The persona's notes (text samples) and chats (user/assistant samples), in file order."""
    return parse_jsonl(_read("mara.jsonl").splitlines(), f"{_DATA_DIR}/mara.jsonl")


def load_questions() -> list[Question]:
    """The demo's questions; none appears verbatim in the training data."""
    return [Question(q["question"], tuple(q["facts"])) for q in json.loads(_read("questions.json"))]


def _fold(text: str) -> str:
    # Case- and accent-insensitive: "Umeå" and "umea" both count.
    return "".join(c for c in unicodedata.normalize("NFKD", text.casefold()) if not unicodedata.combining(c))


def mentions_fact(answer: str, question: Question) -> bool:
    """Whether the answer contains one of the question's facts."""
    folded = _fold(answer)
    return any(_fold(f) in folded for f in question.facts)

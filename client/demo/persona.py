"""The demo's bundled persona (Mara Lindqvist's notes and chats) and the questions that check what was learned."""

from __future__ import annotations

import json
import re
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
    """A question about the persona and what a right answer says.

    Attributes:
        facts: spellings of the expected fact; one must appear (as the start of a word).
        also: further facts that must all appear too (e.g. both running days).
        wrong: claims that make the answer wrong even when it names the fact ("Umeå, in the south of Sweden").
    """

    question: str
    facts: tuple[str, ...]
    also: tuple[str, ...] = ()
    wrong: tuple[str, ...] = ()


def _read(name: str) -> str:
    return resources.files(_PACKAGE).joinpath(_DATA_DIR, name).read_text(encoding="utf-8")


def load_samples() -> list[Sample]:
    """The persona's notes (text samples) and chats (user/assistant samples), in file order."""
    return parse_jsonl(_read("mara.jsonl").splitlines(), f"{_DATA_DIR}/mara.jsonl")


def load_questions() -> list[Question]:
    """The demo's questions; none appears verbatim in the training data."""
    return [
        Question(q["question"], tuple(q["facts"]), tuple(q.get("also", ())), tuple(q.get("wrong", ())))
        for q in json.loads(_read("questions.json"))
    ]


def _fold(text: str) -> str:
    # Case- and accent-insensitive: "Umeå" and "umea" both count.
    return "".join(c for c in unicodedata.normalize("NFKD", text.casefold()) if not unicodedata.combining(c))


def _says(folded: str, term: str) -> bool:
    # A word start, so "Tofu" is not found in "pseudotofu"; "Tuesdays" still counts for "Tuesday".
    return re.search(r"\b" + re.escape(_fold(term)), folded) is not None


def states_fact(text: str, question: Question) -> bool:
    """Whether the text names the expected fact (one spelling of it, and every `also` fact)."""
    folded = _fold(text)
    return any(_says(folded, f) for f in question.facts) and all(_says(folded, f) for f in question.also)


def mentions_fact(answer: str, question: Question) -> bool:
    """Whether the answer gets the fact right: it states the fact and none of the claims that contradict it."""
    return states_fact(answer, question) and not any(_says(_fold(answer), w) for w in question.wrong)

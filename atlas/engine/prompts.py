"""Prompts and output schemas of the engine's tasks (tagging, tag judging).

Small base models (Gemma 3 270M) only follow a format they have seen, so every prompt is a
few-shot completion: an instruction line, worked examples, then the query in the same shape.
Instruction-tuned models get the same examples as chat turns (their chat template renders
them). Structured output (JSON schema / choice) then guarantees the shape of the answer; the
examples steer its content.
"""

from __future__ import annotations

import json
from typing import Any

PROMPT_VERSION = "tags-v1"  # part of every cache key through the prompt text itself

TAG_INSTRUCTION = (
    "Write short topical tags for each text: the subjects, entities, places, periods and fields it is about. "
    "Each tag is a lowercase noun phrase of one to four words. Answer with a JSON list."
)

TAG_EXAMPLES: list[tuple[str, list[str]]] = [
    (
        "Mount Vesuvius is a stratovolcano on the Gulf of Naples in Campania, Italy. Its eruption in AD 79 "
        "destroyed the Roman towns of Pompeii and Herculaneum, burying them under ash and pumice.",
        ["volcanoes", "mount vesuvius", "ancient rome", "pompeii", "natural disasters"],
    ),
    (
        "The club won the league title in 1994 after a final-day victory over its rivals. The striker scored "
        "31 goals that season, and the manager was later appointed to coach the national team.",
        ["association football", "league championship", "football clubs", "sports history"],
    ),
    (
        "Photosynthesis converts light energy into chemical energy stored in glucose. In plants it takes place "
        "in chloroplasts, where chlorophyll absorbs mainly red and blue light and releases oxygen.",
        ["photosynthesis", "plant biology", "chloroplasts", "biochemistry"],
    ),
    (
        "The album was recorded in Los Angeles in 1987 and released by the band's new label. Its lead single "
        "reached number three on the Billboard Hot 100, and critics praised its guitar-driven sound.",
        ["rock music", "music albums", "billboard charts", "1980s music"],
    ),
]

JUDGE_INSTRUCTION = (
    "Rate how relevant the tag is to the text on a scale from 1 to 5: 5 = a central topic of the text, "
    "4 = clearly relevant, 3 = loosely related, 2 = barely related, 1 = unrelated or wrong."
)

JUDGE_EXAMPLES: list[tuple[str, str, int]] = [
    (TAG_EXAMPLES[0][0], "volcanoes", 5),
    (TAG_EXAMPLES[0][0], "football", 1),
    (TAG_EXAMPLES[0][0], "tourism", 2),
    (TAG_EXAMPLES[2][0], "plant biology", 5),
    (TAG_EXAMPLES[2][0], "chemistry", 3),
    (TAG_EXAMPLES[2][0], "world war ii", 1),
    (TAG_EXAMPLES[1][0], "sports history", 4),
    (TAG_EXAMPLES[1][0], "basketball", 2),
]

JUDGE_CHOICES = ["1", "2", "3", "4", "5"]


def tag_schema(max_tags: int, max_tag_chars: int = 60) -> dict[str, Any]:
    """JSON schema of a tagging answer: a non-empty list of at most ``max_tags`` short strings."""
    return {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": int(max_tag_chars)},
        "minItems": 1,
        "maxItems": int(max_tags),
    }


def _clean(text: str) -> str:
    return " ".join(text.split())


def _tags_json(tags: list[str]) -> str:
    return json.dumps(tags, ensure_ascii=False)


def tag_prompt(text: str, chat_template=None) -> str:
    """The tagging prompt for one chunk. ``chat_template``: a callable(messages) -> str for
    instruction-tuned models, None for base models (plain few-shot completion)."""
    text = _clean(text)
    if chat_template is None:
        parts = [TAG_INSTRUCTION, ""]
        for ex_text, ex_tags in TAG_EXAMPLES:
            parts += [f"Text: {ex_text}", f"Tags: {_tags_json(ex_tags)}", ""]
        parts += [f"Text: {text}", "Tags:"]
        return "\n".join(parts)
    messages = [{"role": "system", "content": TAG_INSTRUCTION}]
    for ex_text, ex_tags in TAG_EXAMPLES:
        messages += [{"role": "user", "content": f"Text: {ex_text}"}, {"role": "assistant", "content": _tags_json(ex_tags)}]
    messages.append({"role": "user", "content": f"Text: {text}"})
    return chat_template(messages)


def judge_prompt(text: str, tag: str, chat_template=None) -> str:
    """The judge prompt for one (chunk, tag) pair. The chunk text precedes the tag so that all
    tags of one chunk share a prompt prefix (prefix caching). The base-model prompt ends in
    "Score: " (the separator included), so each answer "1".."5" starts with its own token and
    one next-token distribution scores them all (``Sampling(score_choices=...)``)."""
    text = _clean(text)
    if chat_template is None:
        parts = [JUDGE_INSTRUCTION, ""]
        for ex_text, ex_tag, score in JUDGE_EXAMPLES:
            parts += [f"Text: {ex_text}", f"Tag: {ex_tag}", f"Score: {score}", ""]
        parts += [f"Text: {text}", f"Tag: {tag}", "Score: "]
        return "\n".join(parts)
    messages = [{"role": "system", "content": JUDGE_INSTRUCTION}]
    for ex_text, ex_tag, score in JUDGE_EXAMPLES:
        messages += [{"role": "user", "content": f"Text: {ex_text}\nTag: {ex_tag}"}, {"role": "assistant", "content": str(score)}]
    messages.append({"role": "user", "content": f"Text: {text}\nTag: {tag}"})
    return chat_template(messages)


def judge_choices(chat_template=None) -> list[str]:
    """The answers of a judge prompt: "1".."5" for both prompt forms (the base-model prompt
    carries the space before the answer)."""
    return list(JUDGE_CHOICES)


def judge_sampling_kwargs() -> dict[str, Any]:
    """Keyword arguments of the judge's :class:`~atlas.engine.core.Sampling`: score the five
    answers by their probabilities (one engine step per pair, no sampling)."""
    return {"max_tokens": 1, "temperature": 0.0, "score_choices": tuple(JUDGE_CHOICES)}


def load_json_answer(raw: str | None) -> tuple[object, str | None]:
    """A model's raw answer -> (parsed JSON, None) or (None, reason naming what was wrong)."""
    if raw is None:
        return None, "no output"
    try:
        return json.loads(raw), None
    except ValueError as e:
        return None, f"output is not valid JSON ({e.msg} at char {e.pos}): {raw[:80]!r}"

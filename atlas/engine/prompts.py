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


# Judge examples as (index into TAG_EXAMPLES, tag, score), grouped by text. "extremes" uses only
# 5 (the text is about it) and 1 (it is not), the unrelated tags being other examples' topics:
# a tiny model copies the scale it is shown, and a two-point scale puts its probability on the
# ends, where real and unrelated pairs differ most (see benchmarks/judge_discrimination.py).
JUDGE_EXTREME_EXAMPLES: list[tuple[int, str, int]] = [
    (0, "volcanoes", 5), (0, "association football", 1), (0, "ancient rome", 5), (0, "rock music", 1),
    (1, "photosynthesis", 1), (1, "association football", 5), (1, "volcanoes", 1), (1, "sports history", 5),
    (2, "plant biology", 5), (2, "billboard charts", 1), (2, "chloroplasts", 5), (2, "pompeii", 1),
    (3, "rock music", 5), (3, "biochemistry", 1), (3, "league championship", 1), (3, "music albums", 5),
]
JUDGE_GRADED_EXAMPLES: list[tuple[int, str, int]] = [
    (0, "volcanoes", 5), (0, "association football", 1), (0, "tourism", 3), (0, "ancient rome", 5), (0, "rock music", 1),
    (1, "photosynthesis", 1), (1, "association football", 5), (1, "coaching", 3), (1, "volcanoes", 1),
    (2, "plant biology", 5), (2, "billboard charts", 1), (2, "chemistry", 3), (2, "pompeii", 1),
    (3, "rock music", 5), (3, "biochemistry", 1), (3, "los angeles", 3), (3, "music albums", 5),
]
_EXTREME_INSTRUCTION = "Rate how relevant each tag is to the text: 5 = the text is about this topic, 1 = the text is not about this topic."
_GRADED_INSTRUCTION = (
    "Rate how relevant each tag is to the text: 5 = the text is about this topic, 3 = loosely related, "
    "1 = the text is not about this topic."
)
_QUESTION_INSTRUCTION = "Decide whether each text is about the given topic."

# The judge prompt styles (benchmarks/judge_discrimination.py measures each); the stage uses
# judge.prompt, default DEFAULT_JUDGE_STYLE.
JUDGE_STYLES = ("rubric", "extremes", "graded", "question")
DEFAULT_JUDGE_STYLE = "question"


def _question(tag: str) -> str:
    return f'Is this text about "{tag}"? Answer 1 (no) to 5 (yes).'


def judge_prompt(text: str, tag: str, chat_template=None, style: str = DEFAULT_JUDGE_STYLE) -> str:
    """The judge prompt for one (chunk, tag) pair in one of :data:`JUDGE_STYLES`.

    * ``rubric``: a five-point rubric and 8 examples, one per text (the first judge).
    * ``extremes``: 16 examples scored only 5 (about it) or 1 (not), grouped by text.
    * ``graded``: as extremes plus a "3 = loosely related" example per text.
    * ``question``: "Is this text about <tag>? Answer 1 (no) to 5 (yes)." with the extremes' examples.

    The examples form a shared preamble and the chunk text precedes the tag, so all prompts
    share the preamble and all tags of one chunk share the text (vLLM prefix caching). The
    base-model prompt ends in "Score: " / "Answer: " (the separator included), so each answer
    "1".."5" starts with its own token and one next-token distribution scores them all
    (``Sampling(score_choices=...)``)."""
    if style not in JUDGE_STYLES:
        raise ValueError(f"unknown judge prompt style {style!r}; choose one of {JUDGE_STYLES}")
    text = _clean(text)
    if style == "rubric":
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
    examples = JUDGE_GRADED_EXAMPLES if style == "graded" else JUDGE_EXTREME_EXAMPLES
    instruction = {"extremes": _EXTREME_INSTRUCTION, "graded": _GRADED_INSTRUCTION, "question": _QUESTION_INSTRUCTION}[style]
    if style == "question":
        ask, label = ((lambda t: f"Question: {_question(t)}") if chat_template is None else _question), "Answer"
    else:
        ask, label = (lambda t: f"Tag: {t}"), "Score"
    if chat_template is None:
        parts = [instruction, ""]
        for k, (ex_text, _) in enumerate(TAG_EXAMPLES):
            parts.append(f"Text: {ex_text}")
            parts += [f"{ask(t)}\n{label}: {sc}" for i, t, sc in examples if i == k]
            parts.append("")
        parts += [f"Text: {text}", ask(tag), f"{label}: "]
        return "\n".join(parts)
    messages = [{"role": "system", "content": instruction + " Answer with one digit."}]
    for i, t, sc in examples:
        messages += [{"role": "user", "content": f"Text: {TAG_EXAMPLES[i][0]}\n{ask(t)}"}, {"role": "assistant", "content": str(sc)}]
    messages.append({"role": "user", "content": f"Text: {text}\n{ask(tag)}"})
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

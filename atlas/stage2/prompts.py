"""Prompts and output schemas of Stage 2's LLM tasks (cluster labelling, taxonomy pick).

Kept apart from atlas/engine/prompts.py (Stage 1's prompts). Same shape: a few-shot completion
for base models, the same examples as chat turns for instruction-tuned ones; structured output
(JSON schema / choice) guarantees the answer's shape, the examples steer its content.
"""

from __future__ import annotations

import json
from typing import Any

LABEL_INSTRUCTION = (
    "Each group of tags below was written for passages about one topic. Name the topic in two to five words "
    "and describe it in one sentence. Answer with JSON: {\"name\": ..., \"description\": ...}."
)

LABEL_EXAMPLES: list[tuple[list[str], str, dict[str, str]]] = [
    (
        ["volcanoes", "volcanic eruptions", "stratovolcano", "lava flows", "mount vesuvius"],
        "Mount Vesuvius is a stratovolcano on the Gulf of Naples; its eruption in AD 79 buried Pompeii.",
        {"name": "Volcanoes", "description": "Volcanoes, their eruptions and the landforms and hazards they create."},
    ),
    (
        ["association football", "football clubs", "premier league", "goalkeepers", "league championship"],
        "The club won the league title in 1994 after a final-day victory over its rivals.",
        {"name": "Association football", "description": "The sport of association football, its clubs, players and competitions."},
    ),
    (
        ["photosynthesis", "chloroplasts", "chlorophyll", "plant biology", "light reactions"],
        "Photosynthesis converts light energy into chemical energy stored in glucose.",
        {"name": "Photosynthesis", "description": "How plants and algae turn light, water and carbon dioxide into sugar and oxygen."},
    ),
]


def label_schema(max_name_chars: int = 60, max_description_chars: int = 160) -> dict[str, Any]:
    # 160 characters (~40 tokens) plus a name fit stage2.label_max_new_tokens (96): a small
    # model that rambles is cut by the grammar, not by the token budget mid-string.
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": int(max_name_chars)},
            "description": {"type": "string", "minLength": 8, "maxLength": int(max_description_chars)},
        },
        "required": ["name", "description"],
        "additionalProperties": False,
    }


def _clean(text: str) -> str:
    return " ".join(text.split())


def _query(tags: list[str], examples: list[str]) -> str:
    lines = ["Tags: " + "; ".join(tags)]
    for e in examples:
        lines.append("Passage: " + _clean(e))
    return "\n".join(lines)


def label_prompt(tags: list[str], examples: list[str], chat_template=None) -> str:
    """The labelling prompt for one cluster: its representative tags and example passages."""
    if chat_template is None:
        parts = [LABEL_INSTRUCTION, ""]
        for ex_tags, ex_text, ans in LABEL_EXAMPLES:
            parts += [_query(ex_tags, [ex_text]), "Answer: " + json.dumps(ans), ""]
        parts += [_query(tags, examples), "Answer:"]
        return "\n".join(parts)
    messages = [{"role": "system", "content": LABEL_INSTRUCTION}]
    for ex_tags, ex_text, ans in LABEL_EXAMPLES:
        messages += [{"role": "user", "content": _query(ex_tags, [ex_text])}, {"role": "assistant", "content": json.dumps(ans)}]
    messages.append({"role": "user", "content": _query(tags, examples)})
    return chat_template(messages)


def query_tags(prompt: str) -> list[str]:
    """The query cluster's tags back from a label prompt (the last ``Tags:`` line)."""
    line = [ln for ln in prompt.splitlines() if ln.startswith("Tags: ") or "Tags: " in ln][-1]
    return line.split("Tags: ", 1)[1].split("; ")


TAXONOMY_INSTRUCTION = (
    "Pick the library classification heading that best fits the concept. Answer with the heading's number."
)


def taxonomy_prompt(name: str, description: str | None, candidates: list[str], chat_template=None) -> str:
    body = [f"Concept: {name}" + (f" - {description}" if description else ""), "Headings:"]
    body += [f"{i + 1}. {c}" for i, c in enumerate(candidates)]
    if chat_template is None:
        return "\n".join([TAXONOMY_INSTRUCTION, "", *body, "Answer:"])
    return chat_template([{"role": "system", "content": TAXONOMY_INSTRUCTION}, {"role": "user", "content": "\n".join(body)}])


def taxonomy_choices(n: int, chat_template=None) -> list[str]:
    return [(" " if chat_template is None else "") + str(i + 1) for i in range(n)]

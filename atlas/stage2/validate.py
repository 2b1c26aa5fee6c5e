"""Blind-fit study (paper Table 4): export a rating sheet, score a filled one.

For every sampled concept the sheet pairs its *evidence* (representative tags) with candidate
names in shuffled order; raters score each candidate's fit 1-5 without knowing its source.
Candidate types:

* ``pipeline``  - the concept's own LLM label;
* ``embedding`` - the name of the nearest other concept by label embedding (a hard distractor);
* ``taxonomy``  - the name of another concept in the same LCC top class, not the nearest
  (a same-field distractor);
* ``filler``    - the name of a concept from a different LCC top class (an easy distractor).

The sheet (what raters see) and the key (candidate types) are separate tables joined on
``item_id``. :func:`score` returns mean, sd, n and a 95% CI (normal approximation) per type.
Until people fill a sheet, :func:`llm_rate` fills it with an LLM through the engine layer; its
ratings carry ``rater = "llm:<model>"`` so they are never mistaken for human ratings.
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pyarrow as pa

from atlas.stage2.embed import to_matrix

TYPES = ("pipeline", "embedding", "taxonomy", "filler")


def export_sheet(concepts: pa.Table, n: int | None = None, seed: int = 0) -> tuple[pa.Table, pa.Table]:
    """-> (sheet: item_id, concept_id, evidence, candidate, rating, rater; key: item_id, candidate_type)."""
    rows = concepts.to_pylist()
    if len(rows) < 3:
        raise ValueError(f"a blind-fit sheet needs at least 3 concepts, got {len(rows)}")
    rng = random.Random(seed)
    e = to_matrix(concepts.column("embedding"))
    sims = e @ e.T
    np.fill_diagonal(sims, -np.inf)
    order = list(range(len(rows)))
    rng.shuffle(order)
    chosen = sorted(order[: n or len(rows)])
    sheet, key = [], []
    for i in chosen:
        c = rows[i]
        nearest = int(np.argmax(sims[i]))
        cls = c.get("taxonomy_class")
        same = [j for j in range(len(rows)) if j not in (i, nearest) and cls is not None and rows[j].get("taxonomy_class") == cls]
        other = [j for j in range(len(rows)) if j not in (i, nearest) and rows[j].get("taxonomy_class") != cls]
        cands = [("pipeline", c["name"]), ("embedding", rows[nearest]["name"])]
        if same:
            cands.append(("taxonomy", rows[rng.choice(same)]["name"]))
        if other:
            cands.append(("filler", rows[rng.choice(other)]["name"]))
        rng.shuffle(cands)
        evidence = "; ".join(c["representative_tags"][:8])
        for t, name in cands:
            item = hashlib.sha256(f"{seed}|{c['concept_id']}|{t}".encode()).hexdigest()[:12]
            sheet.append({"item_id": item, "concept_id": c["concept_id"], "evidence": evidence, "candidate": name, "rating": None, "rater": None})
            key.append({"item_id": item, "candidate_type": t})
    sheet_t = pa.Table.from_pylist(sheet, schema=pa.schema([("item_id", pa.string()), ("concept_id", pa.string()), ("evidence", pa.string()),
                                                            ("candidate", pa.string()), ("rating", pa.int8()), ("rater", pa.string())]))
    return sheet_t, pa.Table.from_pylist(key)


def score(sheet: pa.Table, key: pa.Table) -> pa.Table:
    """Mean, sd, n and 95% CI of the ratings per candidate type (unrated items are skipped)."""
    kind = dict(zip(key.column("item_id").to_pylist(), key.column("candidate_type").to_pylist()))
    by: dict[str, list[float]] = {}
    raters: dict[str, set] = {}
    for item, r, who in zip(sheet.column("item_id").to_pylist(), sheet.column("rating").to_pylist(), sheet.column("rater").to_pylist()):
        if r is None:
            continue
        if item not in kind:
            raise ValueError(f"sheet item {item!r} is not in the key")
        if not 1 <= int(r) <= 5:
            raise ValueError(f"sheet item {item!r}: rating {r} is outside 1..5")
        by.setdefault(kind[item], []).append(float(r))
        raters.setdefault(kind[item], set()).add(who or "unknown")
    rows = []
    for t in TYPES:
        v = by.get(t, [])
        n = len(v)
        mean = sum(v) / n if n else None
        sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1)) if n > 1 else None
        half = 1.96 * sd / math.sqrt(n) if sd is not None else None
        rows.append({"candidate_type": t, "n": n, "mean": mean, "sd": sd, "ci_low": None if half is None else mean - half,
                     "ci_high": None if half is None else mean + half, "raters": ",".join(sorted(raters.get(t, set())))})
    return pa.Table.from_pylist(rows)


RATE_INSTRUCTION = "Rate how well the name fits the topic described by the tags, from 1 (not at all) to 5 (perfectly)."


def llm_rate(sheet: pa.Table, engine, cache_root=None, seed: int = 0) -> pa.Table:
    """Fill ``sheet`` with LLM ratings (choice-constrained 1..5), marked ``llm:<model>``."""
    from atlas.engine import Sampling

    template = engine.chat_template
    choices = [str(i) for i in range(1, 6)] if template is not None else [f" {i}" for i in range(1, 6)]
    sk = Sampling(max_tokens=2, temperature=0.0, seed=seed, choice=tuple(choices)).key()
    prompts = []
    for ev, cand in zip(sheet.column("evidence").to_pylist(), sheet.column("candidate").to_pylist()):
        body = f"Tags: {ev}\nName: {cand}"
        prompts.append(template([{"role": "system", "content": RATE_INSTRUCTION}, {"role": "user", "content": body}])
                       if template is not None else f"{RATE_INSTRUCTION}\n\n{body}\nRating:")
    reqs = pa.table({"key": sheet.column("item_id"), "prompt": prompts, "sampling": [sk] * sheet.num_rows})
    out, _ = engine.generate(reqs, cache_root=cache_root)
    ratings = [int(t.strip()) if e is None and t and t.strip().isdigit() else None
               for t, e in zip(out.column("text").to_pylist(), out.column("error").to_pylist())]
    who = f"llm:{engine.model}"
    sheet = sheet.set_column(sheet.schema.get_field_index("rating"), "rating", pa.array(ratings, pa.int8()))
    return sheet.set_column(sheet.schema.get_field_index("rater"), "rater", pa.array([who if r is not None else None for r in ratings], pa.string()))

"""Fig. 9 tables from paired ratings (no Ray): the judge here is a plain function, the real
engine path runs in test_stage2_stages.py and the e2e test."""

from __future__ import annotations

import math

import pyarrow as pa

from atlas import schemas
from atlas.stage2 import judge


def _inputs():
    chunk_ids = ["a", "b", "c"]
    texts = ["about volcano lava", "about chess and volcano", "about chess"]
    labels = pa.table({"chunk_id": ["a", "b", "b", "c", "zzz"], "concept_id": ["c-volcano", "c-volcano", "c-chess", "c-chess", "c-chess"]})
    concepts = pa.table({"concept_id": ["c-chess", "c-lobster", "c-volcano"], "name": ["chess", "lobster", None]})
    return chunk_ids, texts, labels, concepts


def keyword_judge(pairs):
    """5 when the concept name occurs in the text, 1 otherwise; None for 'lobster' (unscored)."""
    return [None if name == "lobster" else (5.0 if name in text else 1.0) for text, name in pairs]


def test_tables_pair_every_assigned_concept_with_a_same_chunk_control():
    chunk_ids, texts, labels, concepts = _inputs()
    tables, summary = judge.judge_concepts(chunk_ids, texts, labels, concepts, keyword_judge, seed=0)
    j = tables["concept_judgements"]
    assert j.schema.equals(schemas.CONCEPT_JUDGEMENTS, check_metadata=False)
    rows = j.to_pylist()
    real = sorted((r["chunk_id"], r["concept_id"]) for r in rows if r["kind"] == "assigned")
    # the label of a chunk outside the sample ("zzz") is not rated
    assert real == [("a", "c-volcano"), ("b", "c-chess"), ("b", "c-volcano"), ("c", "c-chess")]
    by_pair = {}
    for r in rows:
        by_pair.setdefault(r["pair"], {})[r["kind"]] = r
    for p in by_pair.values():
        assert p["assigned"]["chunk_id"] == p["control"]["chunk_id"]
        assert (p["control"]["chunk_id"], p["control"]["concept_id"]) not in set(real)
    # a concept without a name is asked about by its id ("c-volcano" is not in any text: 1)
    scores = {(r["chunk_id"], r["concept_id"]): r["expected_score"] for r in rows if r["kind"] == "assigned"}
    assert scores == {("a", "c-volcano"): 1.0, ("b", "c-chess"): 5.0, ("b", "c-volcano"): 1.0, ("c", "c-chess"): 5.0}
    assert summary["assigned"]["mean"] == 3.0
    # chunk b's only unassigned concept is lobster, which the judge leaves unscored (null, not 0)
    assert {r["concept_id"]: r["expected_score"] for r in rows if r["kind"] == "control" and r["chunk_id"] == "b"} == {"c-lobster": None}
    n_unscored = sum(1 for r in rows if r["expected_score"] is None)
    assert n_unscored == sum(1 for r in rows if r["concept_id"] == "c-lobster")
    by_concept = {r["concept_id"]: r for r in tables["concept_judge_by_concept"].to_pylist()}
    assert by_concept["c-chess"]["n_assigned"] == 2 and by_concept["c-chess"]["mean_assigned"] == 5.0
    by_chunk = {r["chunk_id"]: r for r in tables["concept_judge_by_chunk"].to_pylist()}
    assert by_chunk["b"]["n_concepts"] == 2
    d = summary["difference"]
    assert d["pairs"] == 4 - n_unscored and (d["pairs"] == 0 or d["mean"] > 0)
    assert isinstance(judge.plot(tables["concept_judge_by_chunk"], tables["concept_judge_by_concept"], "t"), bytes)


def test_a_judge_that_rates_everything_alike_reads_zero():
    chunk_ids, texts, labels, concepts = _inputs()
    _, summary = judge.judge_concepts(chunk_ids, texts, labels, concepts, lambda pairs: [3.0] * len(pairs))
    assert summary["difference"]["mean"] == 0.0 and summary["difference"]["ci"] == (0.0, 0.0)
    assert not math.isnan(summary["assigned"]["mean"])


def test_sample_is_deterministic_and_bounded():
    ids = [f"c{i:03d}" for i in range(100)] * 2
    a, b = judge.sample_chunks(ids, 10, seed=1), judge.sample_chunks(ids, 10, seed=1)
    assert a == b and len(a) == len(set(a)) == 10
    assert judge.sample_chunks(ids, 500, seed=1) == sorted(set(ids))

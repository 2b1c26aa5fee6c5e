"""Concepts are actually learned: the planted-concept benchmark on a small budget.

Real corpus (atlas/demo/corpus, in the repository), real training, held-out windows.
The full-budget figures come from benchmarks/concept_learning.py.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import concept_learning as cl  # noqa: E402

STEPS = 300


@pytest.fixture(scope="module")
def planted():
    return cl.build()


def test_planted_labels_are_topic_families_not_tokens(planted):
    # every family has held-out positives and negatives; no family name is needed in a chunk
    assert planted.held_y.any(0).all() and (~planted.held_y).any(0).all()
    road = cl.CONCEPTS.index("road")
    pos_text = [t for t, y in zip(planted.held_text, planted.held_y[:, road]) if y]
    assert sum("road" in t.lower() for t in pos_text) < 0.5 * len(pos_text)


@pytest.mark.slow
def test_cdlm_concept_detects_held_out_concepts(planted):
    res = cl.train_run("cdlm_concept", planted, cl.SIZES["tiny"], STEPS)
    assert res["concept_auc"] >= 0.8, res
    assert 0 <= res["concept_contribution"] <= 1


@pytest.mark.slow
def test_random_label_control_stays_at_chance():
    rnd = cl.build(random_labels=True)
    res = cl.train_run("cdlm_concept", rnd, cl.SIZES["tiny"], STEPS)
    assert abs(res["concept_auc"] - 0.5) <= 0.05, res

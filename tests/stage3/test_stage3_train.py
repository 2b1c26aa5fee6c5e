"""Stage 3 annotators: features, threshold calibration, metrics, and real training under Ray Train."""

from __future__ import annotations

import numpy as np
import pytest

from atlas import storage
from atlas.config import Stage3Config
from atlas.stage3 import evaluate, labels, train
from atlas.stage3.annotators import Annotator, AnnotatorError, hash_features
from tests.stage3.fixtures import planted


def test_hash_features_are_deterministic_and_padded():
    a = hash_features(["Red fox jumps", ""], buckets=1000, ngrams=2, max_features=8)
    b = hash_features(["red FOX jumps", ""], buckets=1000, ngrams=2, max_features=8)
    assert (a == b).all()  # lower-cased, crc32: same ids in any process
    assert (a[0, :5] < 1000).all() and (a[0, 5:] == 1000).all()  # 3 words + 2 bigrams, then padding
    assert (a[1] == 1000).all()
    long = hash_features([" ".join(f"w{i}" for i in range(100))], 1000, 2, 16)
    assert (long < 1000).all()  # truncated at max_features


def test_calibrate_thresholds_picks_the_f1_optimal_cut():
    scores = np.array([[0.9], [0.8], [0.6], [0.3], [0.2]], np.float32)
    y = np.array([[1], [1], [0], [1], [0]])
    th = train.calibrate_thresholds(scores, y)
    # cut after 0.3 keeps 4 (tp 3) -> F1 = 6/7; after 0.8 keeps 2 (tp 2) -> 0.8
    assert 0.2 < th[0] < 0.3
    none = train.calibrate_thresholds(scores, np.zeros_like(y), default=0.5)
    assert none[0] == 0.5


def test_metrics_and_kappa_on_known_cases():
    true = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], bool)
    perfect = evaluate.metrics(true, true)
    assert perfect["micro_f1"] == 1 and perfect["kappa"] == 1 and perfect["macro_f1"] == 1
    pred = np.array([[1, 0], [0, 0], [1, 1], [1, 0]], bool)
    m = evaluate.metrics(pred, true)
    # pooled: tp 3, fp 1, fn 1, tn 3 -> F1 0.75; po 0.75, pe 0.5 -> kappa 0.5
    assert m["micro_f1"] == pytest.approx(0.75) and m["kappa"] == pytest.approx(0.5)
    assert m["per_concept"][1]["precision"] == 1 and m["per_concept"][1]["recall"] == 0.5
    rng = np.random.default_rng(0)
    big = rng.random((4000, 5)) < 0.2
    ctrl = evaluate.random_control(big, seed=1)
    assert abs(evaluate.metrics(ctrl, big)["kappa"]) < 0.05  # chance agreement reads ~0
    ci = evaluate.bootstrap_ci(pred, true, n_boot=200)
    assert ci["micro_f1"][0] <= 0.75 <= ci["micro_f1"][1]


def _keyword_judge(pairs):
    """Rates 5 when a cue word of the named planted concept is in the text, else 1."""
    from tests.stage3.fixtures import CONCEPTS

    return [5.0 if set(CONCEPTS[f"c-{name}"].split()) & set(text.split()) else 1.0 for text, name in pairs]


def test_judge_ratings_pair_each_prediction_with_an_unpredicted_concept_of_the_same_chunk():
    texts = ["planet orbit", "recipe oven", "goal striker"]
    names = ["astronomy", "cooking", "football", "finance"]
    pred = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1]], bool)  # the last one is wrong on finance
    asked = []

    def judge(pairs):
        asked.extend(pairs)
        return _keyword_judge(pairs)

    r = evaluate.judge_ratings(texts, pred, names, judge, seed=3)
    n = int(pred.sum())
    assert r["predicted"]["pairs"] == r["random_concept"]["pairs"] == r["difference"]["pairs"] == n
    real, ctrl = asked[:n], asked[n:]
    by_text = {t: {names[j] for j in np.flatnonzero(p)} for t, p in zip(texts, pred)}
    assert [t for t, _ in real] == [t for t, _ in ctrl]  # the control keeps the chunk
    assert all(c not in by_text[t] for t, c in ctrl)  # and swaps in a concept not predicted for it
    assert r["predicted"]["mean"] == pytest.approx((5 + 5 + 5 + 1) / 4) and r["random_concept"]["mean"] == 1.0
    lo, hi = r["difference"]["ci"]
    assert r["difference"]["mean"] == pytest.approx(3.0) and lo <= 3.0 <= hi
    flat = evaluate.judge_ratings(texts, pred, names, lambda ps: [3.0] * len(ps))  # a judge that knows nothing
    assert flat["difference"]["mean"] == 0 and flat["difference"]["ci"] == (0.0, 0.0)
    none = evaluate.judge_ratings(texts, pred, names, lambda ps: [None] * len(ps))  # unscored pairs are counted, not rated
    assert none["predicted"]["rated"] == 0 and none["difference"]["pairs"] == 0 and np.isnan(none["difference"]["mean"])


def test_labelled_chunks_rejects_unknown_concepts_and_splits_stably():
    chunks, cc, concepts = planted(40)
    ids = concepts.column("concept_id").to_pylist()
    data = labels.labelled_chunks(chunks, cc, ids, chunks.column("chunk_id").to_pylist())
    assert data.y.shape == (40, len(ids)) and data.y.sum() == cc.num_rows
    assert data.library_version == labels.library_version(sorted(ids))
    with pytest.raises(labels.LabelError, match="missing from the library"):
        labels.labelled_chunks(chunks, cc, ids[:2])
    s1 = labels.split_of(data.chunk_ids, 0.2, 0.2)
    s2 = labels.split_of(data.chunk_ids[:20], 0.2, 0.2)
    assert (s1[:20] == s2).all()  # a chunk's split does not depend on the others


def _train_and_check(kind: str, s3: Stage3Config, n: int, min_f1: float, tmp_path) -> None:
    chunks, cc, concepts = planted(n)
    data = labels.labelled_chunks(chunks, cc, concepts.column("concept_id").to_pylist(), chunks.column("chunk_id").to_pylist())
    ann, info = train.train_annotator(kind, data, s3)
    assert info["stats"]["concepts_never_predicted"] == 1 and ann.cfg.thresholds[data.concept_ids.index("c-rare")] > 1
    test = info["split"] == "test"
    pred = ann.decide(info["test_scores"])
    res = evaluate.evaluate(pred, data.y[test].astype(bool), n_boot=100)
    assert res["annotator"]["micro_f1"] >= min_f1, res["annotator"]
    assert res["annotator"]["micro_f1"] > res["random_control"]["micro_f1"] + 0.3
    # safetensors + JSON round trip, versioned with the library
    loc = ann.save(storage.resolve(str(tmp_path / kind)))
    back = Annotator.load(loc, expect_library_version=data.library_version)
    texts = data.texts[:16]
    assert np.allclose(back.scores(texts), ann.scores(texts), atol=1e-6)
    assert back.annotate(texts) == ann.annotate(texts)
    with pytest.raises(AnnotatorError, match="concept library"):
        Annotator.load(loc, expect_library_version="lib-other")
    png = evaluate.plot({kind: res}, str(tmp_path / f"{kind}.png"))
    assert (tmp_path / f"{kind}.png").stat().st_size > 1000, png


@pytest.mark.slow
def test_fast_annotator_trains_with_two_ray_train_workers(ray_cluster, tmp_path):
    s3 = Stage3Config(hash_buckets=4096, hash_dim=16, epochs=25, batch_size=32, learning_rate=0.05, train_workers=2, cpus_per_train_worker=0.5)
    _train_and_check("fast", s3, 300, 0.85, tmp_path)


@pytest.mark.slow
def test_encoder_annotator_through_the_stage_function(ray_cluster, tmp_path):
    """stage3_train's body: MiniLM features, Ray Train head, held-out eval saved beside the model."""
    from atlas.config import RunConfig
    from atlas.stage3 import stages

    cfg = RunConfig(stage3=Stage3Config(annotator="encoder", epochs=40, batch_size=32, learning_rate=0.05, cpus_per_train_worker=0.5))
    chunks, cc, concepts = planted(200)
    root = storage.resolve(str(tmp_path / "run"))
    names = dict(zip(concepts.column("concept_id").to_pylist(), concepts.column("name").to_pylist()))
    stats = stages.train_and_evaluate(
        root, cfg, chunks, cc, concepts.column("concept_id").to_pylist(), chunks.column("chunk_id").to_pylist(), names, _keyword_judge, "keywords"
    )
    assert stats["micro_f1"] >= 0.6 and stats["micro_f1"] > stats["random_micro_f1"] + 0.3, stats
    loc = storage.resolve(stats["annotator_uri"])
    ann = Annotator.load(loc, expect_library_version=stats["library_version"])
    assert ann.kind == "encoder" and len(ann.cfg.thresholds) == len(concepts)
    for name in ("eval.json", "eval.md", "eval.png"):
        assert storage.exists(loc.join(name)), name
    report = storage.read_bytes(loc.join("eval.md")).decode()
    assert "random control" in report and "| astronomy |" in report and "random_concept" in report
    # Fig. 10's judge ratings: predicted concepts rated relevant, random ones of the same chunks not.
    assert stats["judge_pairs"] > 20 and stats["judge_predicted_mean"] > 4 and stats["judge_random_concept_mean"] < 2, stats


def test_vectorised_hashing_matches_a_per_text_reference():
    from atlas.stage3 import annotators as A

    def ref(texts, buckets, ngrams, maxf, c):
        out = np.full((len(texts), maxf), buckets, np.int64)
        for i, t in enumerate(texts):
            ents = [A._word_entry(w, c) for w in A._WORD.findall(t.lower())]
            if not ents:
                continue
            h = np.array([e[0] for e in ents], np.uint64)
            parts = [h]
            for n in range(2, ngrams + 1):
                if len(h) < n:
                    break
                g = h[: len(h) - n + 1].copy()
                for k in range(1, n):
                    g = (g * A._MIX + h[k : len(h) - n + 1 + k] + np.uint64(n)) & A._MASK32
                parts.append(g)
            if c:
                parts += [e[1] for e in ents]
            ids = np.concatenate(parts)[:maxf] % np.uint64(buckets)
            out[i, : len(ids)] = ids
        return out

    texts = ["Red fox jumps", "", "a", "x y", " ".join(f"w{i}" for i in range(200)), "the cat sat on the mat. The dog!"]
    for ng in (1, 2, 3):
        for c in (0, 4):
            for mf in (4, 384):
                assert (A.hash_features(texts, 1000, ng, mf, c) == ref(texts, 1000, ng, mf, c)).all(), (ng, c, mf)


def test_flat_features_and_vectorised_decisions_match_per_row_references():
    """Inference (flat ids + offsets) scores like training's padded rows; select() equals a per-row top-k."""
    import torch

    from atlas.stage3 import annotators as A

    texts = ["Red fox jumps over the lazy dog", "", "a", "the cat sat on the mat. The dog!", " ".join(f"w{i}" for i in range(300))]
    flat, offsets = A.hash_features_flat(texts, 4096, 2, 64, 4)
    padded = A.hash_features(texts, 4096, 2, 64, 4)
    assert list(np.diff(offsets)) == [int((r < 4096).sum()) for r in padded]
    assert (flat == padded[padded < 4096]).all()
    torch.manual_seed(0)
    cfg = A.AnnotatorConfig(kind="fast", concept_ids=[f"c{i}" for i in range(6)], library_version="lib-t", hash_buckets=4096,
                            hash_dim=8, max_features=64, char_ngrams=4, max_concepts_per_chunk=2)
    ann = A.Annotator(cfg, A.build_head(cfg))
    assert np.allclose(ann.scores(texts), ann.scores_from_features(padded), atol=1e-6)
    rng = np.random.default_rng(1)
    s = np.round(rng.random((50, 6)), 1).astype(np.float32)  # rounded: many ties
    off, ids, sc = ann.select(s)
    for i, row in enumerate(s):
        idx = np.flatnonzero(row >= 0.5)
        idx = idx[np.argsort(-row[idx], kind="stable")][:2]
        assert ids[off[i] : off[i + 1]].tolist() == idx.tolist() and np.allclose(sc[off[i] : off[i + 1]], row[idx])
    assert ann.annotate([]) == ([], [])

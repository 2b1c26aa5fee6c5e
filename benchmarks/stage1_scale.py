"""Driver memory of Stage 1 tagging at scale: does it stay flat as the chunk table grows?

Synthetic ``chunks`` tables (default 20k and 200k rows, ~100-word texts) go through the real
tag stage (``atlas.stage1_tags.TagStage`` on a local Ray cluster: prompts, cache keys, engine
actors, per-batch cache writes, parse, per-part publish) with the fast deterministic test
engine (``engine.backend: test``, atlas/engine/testing.py) standing in for the LLM, so the
figures measure the pipeline, not a model. Each size runs in a fresh driver process (peak RSS
is a per-process high-water mark); with ``--rerun`` (default) the same process then reruns
the stage, which now joins every request with the cache inside Ray Data.

Prints, per size: driver peak RSS after Ray start-up (baseline), after the first run and
after the cached rerun, rows/s, and the ratio largest/smallest (target <= 1.2), with
``os.getloadavg()`` - figures measured on a shared, loaded machine are rough.

    python benchmarks/stage1_scale.py [--sizes 20000,200000] [--no-rerun]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster; no token set-up
sys.path.insert(0, str(REPO))

WORDS = (
    "river castle battle music album league season station railway harbour empire treaty garden volcano "
    "senate novel painter galaxy protein bridge festival island dynasty cathedral highway theatre glacier"
).split()


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synth(batch):
    """Chunk rows for ids in ``batch['id']`` (runs in Ray tasks, not on the driver)."""
    import numpy as np
    import pyarrow as pa

    ids = batch["id"]
    texts, cids, docs = [], [], []
    for i in ids.tolist():
        rng = np.random.default_rng(i)
        texts.append(" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 100)) + ".")
        docs.append(f"doc{i // 40:07d}")
        cids.append(f"doc{i // 40:07d}-{i % 40:05d}")
    n = len(ids)
    return pa.table(
        {
            "chunk_id": cids, "doc_id": docs, "chunk_index": pa.array(ids % 40, pa.int32()), "text": texts,
            "n_tokens": pa.array([100] * n, pa.int32()), "char_start": pa.array([0] * n, pa.int64()),
            "char_end": pa.array([len(t) for t in texts], pa.int64()),
        }
    )


def one(n: int, rerun: bool) -> dict:
    """Run in a fresh process: build ``n`` synthetic chunks, tag them (and again from cache)."""
    import ray

    from atlas import schemas, storage
    from atlas.config import EngineConfig, RunConfig, Stage1Config
    from atlas.console import route_ray_logs
    from atlas.stage import REGISTRY, StageContext, load_stages

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = tempfile.mkdtemp(prefix="atlas-scale-")
    ray.init(address="local", num_cpus=2, object_store_memory=512 * 2**20, include_dashboard=False,
             _temp_dir=os.path.join(tmp, "ray"), log_to_driver=False)
    route_ray_logs(os.path.join(tmp, "ray.log"))
    load_stages()
    root = storage.resolve(os.path.join(tmp, "out"))
    cfg = RunConfig(engine=EngineConfig(backend="test", batch_size=512, cpus_per_replica=1.0), stage1=Stage1Config(max_chunks=None))
    base = peak_mib()
    chunks = ray.data.range(n, override_num_blocks=max(4, n // 5000)).map_batches(synth, batch_format="numpy")
    StageContext(root, cfg, "bench", "synth").publish("chunks", chunks, schemas.CHUNKS)
    after_synth = peak_mib()
    res = {"rows": n, "baseline_mib": round(base, 1), "after_synth_mib": round(after_synth, 1)}
    stage = REGISTRY["stage1_tags"]
    t0 = time.perf_counter()
    stats = stage.run(StageContext(root, cfg, "bench", "stage1_tags"))
    res.update(first_s=round(time.perf_counter() - t0, 1), first_mib=round(peak_mib(), 1), first_generated=stats["generated"])
    assert stats["rows"] == n and stats["generated"] == n, stats
    if rerun:
        t0 = time.perf_counter()
        stats = stage.run(StageContext(root, cfg, "bench", "stage1_tags"))
        res.update(rerun_s=round(time.perf_counter() - t0, 1), rerun_mib=round(peak_mib(), 1), rerun_cached=stats["cached"])
        assert stats["rows"] == n and stats["cached"] == n and stats["generated"] == 0, stats
    ray.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="20000,200000")
    ap.add_argument("--no-rerun", action="store_true", help="skip the cached rerun (the cache-join path)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, not args.no_rerun)), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "RAY_ADDRESS": ""}
    results = []
    for n in [int(x) for x in args.sizes.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(n)] + (["--no-rerun"] if args.no_rerun else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise SystemExit(f"size {n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        r = json.loads(line[-1][7:])
        r["load"] = [round(x, 1) for x in os.getloadavg()]
        results.append(r)
        print(
            f"{n:>8} chunks: driver peak RSS baseline {r['baseline_mib']:.0f} MiB, first run {r['first_mib']:.0f} MiB "
            f"({n / r['first_s']:.0f} rows/s)"
            + (f", cached rerun {r['rerun_mib']:.0f} MiB ({n / r['rerun_s']:.0f} rows/s)" if "rerun_mib" in r else "")
            + f"; load {r['load']}",
            flush=True,
        )
    lo, hi = results[0], results[-1]
    key = "rerun_mib" if "rerun_mib" in hi else "first_mib"
    ratio = hi[key] / lo[key]
    print(f"driver peak RSS ratio {hi['rows']} / {lo['rows']} rows: {ratio:.3f} (target <= 1.2) -> {'OK' if ratio <= 1.2 else 'FAIL'}")
    print(f"os.getloadavg(): {os.getloadavg()}  (a shared 2-core machine: timings are rough, memory figures are not)")
    sys.exit(0 if ratio <= 1.2 else 1)


if __name__ == "__main__":
    main()

"""`atlas train`: train Steerling on annotation shards with Ray Train + DeepSpeed (thin CLI).

    atlas train --config train.yaml [--address HOST:PORT] [--set train.steps=200]
    atlas train --demo [--output steerling-demo]     # tiny model, CPU, a few minutes

All logic lives in ``model.train`` (``run_job``, ``demo_job``); this module parses and prints.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_commands"]

DEMO_OUTPUT = "steerling-demo-output"


def _atlas_demo_run() -> str | None:
    """The output of `atlas demo` in this directory when it has published annotations (the
    demo's second step trains on them); None: the STAND-IN labels of the demo corpus."""
    from atlas import storage
    from atlas.cli import DEMO_OUTPUT as ATLAS_DEMO

    path = os.path.abspath(ATLAS_DEMO)
    if os.path.isdir(path) and storage.table_exists(storage.resolve(path), "annotations"):
        print(f"atlas train --demo: training on the annotations of the Atlas demo run at {path}")
        return path
    print(f"atlas train --demo: no Atlas demo run with annotations at {path} (run `atlas demo` first): "
          "STAND-IN labels of the demo corpus (model/labels.py)")
    return None


def _train(a: argparse.Namespace) -> int:
    from atlas.config import ConfigError
    from model.train import demo_job, load_job_config, run_job

    try:
        if a.demo:
            job = demo_job(a.output or os.path.abspath(DEMO_OUTPUT), data=a.data or _atlas_demo_run(), overrides=a.set)
        elif not a.config:
            print("atlas train: give --config FILE or --demo", file=sys.stderr)
            return 2
        else:
            job = load_job_config(a.config, a.set, output=a.output)
    except ConfigError as e:
        print(f"atlas train: {e}", file=sys.stderr)
        return 2
    from atlas import logs

    logs.setup(a.log_file)
    store = a.object_store_mb or (512 if a.demo else None)  # the tiny demo needs little
    res = run_job(job, address=a.address, num_cpus=a.num_cpus, object_store_mb=store)
    f = res.final
    print(f"model:   {res.checkpoint}")
    print(f"metrics: {job.output.rstrip('/')}/metrics/ (steps.parquet, eval.parquet, loss_curves.png)")
    print(f"manifest: {job.output.rstrip('/')}/_manifest.json")
    keys = ("val_loss", "concept_loss", "concept_independence_loss", "concept_contribution",
            "concept_rank_alignment", "concept_auc", "concept_auc_base_rate", "concept_auc_macro", "tokens_per_s", "restarts")
    print("final:   " + ", ".join(f"{k}={f[k]:.4g}" for k in keys if isinstance(f.get(k), (int, float))))
    return 0


def add_commands(subparsers) -> None:
    t = subparsers.add_parser("train", help="train Steerling on concept-annotated shards (Ray Train + DeepSpeed)")
    t.add_argument("--config", help="training job YAML (model, train, data, dist, output)")
    t.add_argument("--demo", action="store_true",
                   help=f"tiny Steerling on the annotations of `atlas demo` (./atlas-demo-output; STAND-IN labels of the "
                        f"demo corpus when there is none), output ./{DEMO_OUTPUT}")
    t.add_argument("--data", help="with --demo: an Atlas run root holding an `annotations` table instead of the demo corpus")
    t.add_argument("--output", help="output URI (overrides the config's)")
    t.add_argument("--address", help="Ray address (default: a private local Ray)")
    t.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    t.add_argument("--object-store-mb", type=int, default=None, help="object store cap of the local Ray")
    t.add_argument("--log-file", help="also write JSON-lines logs (per-eval metrics) here")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.steps=200")
    t.set_defaults(func=_train)

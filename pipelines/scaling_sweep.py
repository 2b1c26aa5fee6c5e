"""Ray job: train a planned IsoFLOP grid, collect one Parquet table, fit the scaling laws.

    python -m pipelines.scaling_sweep --budgets 1e10 3e10 --families cdlm_concept \\
        --sizes 3 --out runs/scaling            # local Ray, or --address / RAY_ADDRESS
    ray job submit -- python -m pipelines.scaling_sweep --plan plan.json --out runs/scaling

Thin entrypoint: the sweep lives in ``model.sweep`` (runs go through the Ray Train +
DeepSpeed trainer ``model.train:train`` by default; ``--trainer model.loop:train`` runs
single-process runs as Ray tasks).
"""

from __future__ import annotations

import sys

from model.sweep import (  # noqa: F401  (re-exported for existing callers)
    DEFAULT_TRAINER, INTERP_METRICS, SweepResult, build_arg_parser, default_corpus, main, plan_from_args,
    run_from_args, run_sweep, summarize, train_one,
)

if __name__ == "__main__":
    sys.exit(main())

"""Ray job: train Steerling on annotation shards (Ray Train + DeepSpeed).

    ray job submit --working-dir . -- python -m pipelines.train_steerling --config train.yaml
    python -m pipelines.train_steerling --demo --output /tmp/steerling-demo

Thin entrypoint over ``model.train.run_job``; under ``ray job submit`` the cluster comes
from RAY_ADDRESS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from model.train import demo_job, load_job_config, run_job

    p = argparse.ArgumentParser(prog="python -m pipelines.train_steerling", description=__doc__.split("\n\n")[0])
    p.add_argument("--config")
    p.add_argument("--demo", action="store_true")
    p.add_argument("--output")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--address", default=None)
    a = p.parse_args(argv)
    if a.demo:
        job = demo_job(a.output or os.path.abspath("steerling-demo-output"), overrides=a.set)
    elif a.config:
        job = load_job_config(a.config, a.set, output=a.output)
    else:
        p.error("give --config FILE or --demo")
    res = run_job(job, address=a.address or os.environ.get("RAY_ADDRESS"))
    print(json.dumps({"model": res.checkpoint, "output": job.output, "final": res.final}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

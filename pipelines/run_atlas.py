"""Ray job entrypoint: run the Atlas stages on a corpus.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python -m pipelines.run_atlas --config run.yaml --input s3://bucket/corpus --output s3://bucket/runs/r1

Inside a Ray job the driver is already on the cluster, so ``ray.init()`` (address "auto")
connects to it instead of starting a local one.
"""

from __future__ import annotations

import sys

from atlas.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--address" or a.startswith("--address=") for a in argv):
        argv += ["--address", "auto"]
    sys.exit(main(["run", *argv]))

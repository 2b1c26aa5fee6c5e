"""The one Ray connection helper shared by pipelines, the trainer and the scaling sweep.

``ray_session(ray_cfg)`` uses a Ray that is already initialised, connects to
``ray_cfg.address`` when one is given, or starts a private local cluster (its own temp dir,
``address="local"`` so it never attaches to another cluster on the host) and stops it after.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

from atlas.config import RayConfig

# Workers on every node need these; nothing may reach a model hub at run time.
BASE_ENV_VARS = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@contextlib.contextmanager
def ray_session(ray_cfg: RayConfig) -> Iterator[None]:
    import ray

    if ray.is_initialized():
        yield
        return
    env = {"env_vars": dict(BASE_ENV_VARS)}
    if ray_cfg.address:
        ray.init(address=ray_cfg.address, runtime_env=env, log_to_driver=False)
    else:
        temp = tempfile.mkdtemp(prefix="atlas-ray-", dir=os.environ.get("ATLAS_RAY_TMP", "/tmp"))
        ray.init(
            address="local",
            num_cpus=ray_cfg.num_cpus,
            object_store_memory=(ray_cfg.object_store_memory_mb or 0) * 2**20 or None,
            include_dashboard=False,
            _temp_dir=temp,
            runtime_env=env,
            log_to_driver=False,
        )
    try:
        yield
    finally:
        ray.shutdown()

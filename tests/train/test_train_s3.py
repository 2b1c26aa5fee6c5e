"""Checkpoints and outputs on S3 (moto), and a second `train` call on the same output
resuming from the latest checkpoint instead of starting over."""

from __future__ import annotations

import json

import polars as pl
import pytest

pytestmark = pytest.mark.slow


def test_s3_run_resumes_from_its_latest_checkpoint(s3_server, s3_client, annotation_root_s3, ray_local, tmp_path):
    # s3_server before ray_local: the test credentials are in the environment Ray workers inherit
    import pyarrow.fs as pafs
    import torch

    from atlas import storage
    from atlas.config import StorageConfig
    from model.config import ModelConfig, TrainConfig
    from model.data import DataConfig
    from model.io import load_pretrained
    from model.train import DistConfig, train
    from tests.train.conftest import N_CONCEPTS

    s3_client.create_bucket(Bucket="train-out")
    out = "s3://train-out/steerling/run-1"
    mcfg = ModelConfig.preset("tiny", n_known=N_CONCEPTS, max_seq_len=64)
    data = DataConfig(annotations=annotation_root_s3, s3_endpoint=s3_server, val_fraction=0.1)
    dist = DistConfig(num_workers=2, cpus_per_worker=0.5, zero_stage=2, s3_endpoint=s3_server)

    def tc(steps):
        return TrainConfig(steps=steps, batch_size=4, seq_len=64, dtype="bf16", warmup_steps=1, eval_batches=1)

    train(mcfg, tc(2), data, out, dist=dist, progress=False)
    res = train(mcfg, tc(4), data, out, dist=dist, progress=False)

    loc = storage.resolve(out, StorageConfig(s3_endpoint=s3_server))
    man = storage.read_json(loc.join("_manifest.json"))
    # bf16 autocast on CPU workers too, with fp32 weights and optimizer state
    assert man["last_report"]["zero_stage"] == 2 and man["last_report"]["compute_dtype"] == "bf16"
    assert man["final"]["restarts"] == 1
    assert [r["step"] for r in man["restores"]] == [2]
    assert man["restores"][0]["saved_digest"] == man["restores"][0]["restored_digest"]
    assert man["checkpoint_uri"].startswith("train-out/steerling/run-1/ray/")
    with loc.fs.open_input_file(loc.join("metrics", "steps.parquet").path) as f:
        steps = pl.read_parquet(f)
    assert steps.select("step", "attempt").rows() == [(0, 0), (1, 0), (2, 1), (3, 1)]
    local = tmp_path / "model"
    local.mkdir()  # pyarrow copies into an existing local folder
    pafs.copy_files(loc.join("model").path, str(local), source_filesystem=loc.fs,
                    destination_filesystem=pafs.LocalFileSystem())
    model, _, names = load_pretrained(local)
    from model.train import weights_digest

    assert weights_digest(model) == man["final_digest"] and len(names) == N_CONCEPTS
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert res.final["steps"] == 4 and json.dumps(man)  # manifest is plain JSON

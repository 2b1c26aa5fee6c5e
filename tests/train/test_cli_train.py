"""`atlas train` parsing and job configs (fast; the training itself is in test_train_distributed)."""

from __future__ import annotations

import pytest

from atlas.cli import main
from atlas.config import ConfigError


def test_train_needs_a_config_or_demo(capsys):
    assert main(["train"]) == 2
    assert "--config" in capsys.readouterr().err


def test_job_config_names_unknown_keys(tmp_path):
    from model.train import load_job_config

    p = tmp_path / "job.yaml"
    p.write_text("output: /tmp/x\ndata: {annotations: /tmp/y}\ndist: {num_wokers: 2}\n")
    with pytest.raises(ConfigError, match=r"dist.num_wokers: unknown key"):
        load_job_config(str(p))
    job = load_job_config(None, ["dist.zero_stage=2", "train.steps=7"], output="s3://b/run",
                          data={"annotations": "s3://b/atlas"})
    assert job.dist.zero_stage == 2 and job.train["steps"] == 7 and job.output == "s3://b/run"


def test_model_known_slots_follow_the_library():
    from model.train import TrainJobConfig, build_configs

    job = TrainJobConfig(output="/tmp/x", data={"annotations": "/tmp/y"})
    m, t = build_configs(job, 3)
    assert m.n_known == 3 and m.topk_known == 3
    m, _ = build_configs(job, 200)
    assert m.n_known == 200 and m.topk_known == 4


def test_batch_must_split_over_workers_and_accumulation():
    import ray

    from model.config import ModelConfig, TrainConfig
    from model.train import train

    with pytest.raises(ValueError, match=r"batch_size 6 must be divisible by num_workers x grad_accum = 2 x 2"):
        train(ModelConfig.preset("tiny"), TrainConfig(steps=1, batch_size=6), "/nonexistent",
              dist={"num_workers": 2, "grad_accum": 2})
    if not ray.is_initialized():
        with pytest.raises(RuntimeError, match="needs a connected Ray"):
            train(ModelConfig.preset("tiny"), TrainConfig(steps=1, batch_size=4), "/nonexistent")

"""Ray Train + DeepSpeed trainer on 2 CPU workers: a DeepSpeed engine with ZeRO-partitioned
optimizer state, loss going down, exact restore, and recovery from a killed worker."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest

pytestmark = pytest.mark.slow


def test_two_workers_zero1_survive_a_killed_worker(ray_local, annotation_root, tmp_path):
    from model.config import ModelConfig, TrainConfig
    from model.data import DataConfig
    from model.io import load_pretrained
    from model.train import DistConfig, FaultInjection, train, weights_digest
    from tests.train.conftest import N_CONCEPTS

    mcfg = ModelConfig.preset("tiny", n_known=N_CONCEPTS, max_seq_len=64)
    tcfg = TrainConfig(steps=8, batch_size=4, seq_len=64, dtype="fp32", warmup_steps=1, lr=3e-3,
                       eval_batches=1, eval_every=4)
    marker = tmp_path / "fault-fired"
    dist = DistConfig(num_workers=2, cpus_per_worker=0.5, zero_stage=1, checkpoint_every=3,
                      fault=FaultInjection(step=4, rank=1, marker=str(marker)))
    out = tmp_path / "run"
    res = train(mcfg, tcfg, DataConfig(annotations=annotation_root, val_fraction=0.1), str(out), dist=dist)

    assert marker.exists(), "the injected fault never fired"
    man = json.loads((out / "_manifest.json").read_text())
    fin = man["final"]
    assert fin["restarts"] == 1
    # the engine and ZeRO-1: each of the 2 ranks holds about half of the Adam moments
    ck = man["last_report"]
    assert ck["engine"] == "DeepSpeedEngine" and ck["optimizer"] == "DeepSpeedZeroOptimizer"
    assert ck["zero_stage"] == 1 and ck["world_size"] == 2
    assert ck["n_params"] / 2 <= ck["opt_state_numel"] <= ck["n_params"] / 2 + 64, ck
    # the restarted group started from the step-3 checkpoint with identical weights
    (restore,) = man["restores"]
    assert restore["step"] == 3 and restore["saved_digest"] == restore["restored_digest"]
    steps = pl.read_parquet(out / "metrics" / "steps.parquet")
    assert steps.filter(pl.col("attempt") == 0)["step"].to_list()[:3] == [0, 1, 2]
    resumed = steps.filter(pl.col("attempt") == 1)
    assert ((steps["data_s"] >= 0) & (steps["data_s"] < steps["step_s"])).all()
    assert 0 <= man["final"]["data_wait_share"] < 1
    assert resumed["step"].to_list() == [3, 4, 5, 6, 7]  # continues, does not start over
    first = steps["loss"][0]
    before = steps.filter((pl.col("attempt") == 0) & (pl.col("step") == 2))["loss"][0]
    assert resumed["loss"][0] < first - 0.2 * abs(first - before)  # not back at the initial loss
    # a few steps lower the loss (train and held-out)
    assert resumed["loss"].tail(2).mean() < first
    ev = pl.read_parquet(out / "metrics" / "eval.parquet")
    assert ev["step"].to_list() == [0, 4, 8]
    assert ev["val_loss"][-1] < ev["val_loss"][0]
    for m in ("concept_loss", "concept_independence_loss", "concept_contribution", "concept_auc"):
        assert math.isfinite(ev[m][-1]), m
    assert (out / "metrics" / "loss_curves.png").stat().st_size > 5000
    # the exported model is exactly the last checkpoint's weights
    model, tok, names = load_pretrained(out / "model")
    assert weights_digest(model) == man["final_digest"] and tok is not None and len(names) == N_CONCEPTS
    assert man["annotation_run"]["run_id"] == "fixture-run"
    assert man["concept_library"]["version"] == "standin-0" and man["concept_library"]["n_concepts"] == N_CONCEPTS
    assert res.final["val_loss"] == ev["val_loss"][-1]

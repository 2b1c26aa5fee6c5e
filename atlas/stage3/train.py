"""Annotator training: the head is fitted under Ray Train, thresholds on a validation split.

Features are computed by a Ray Data operator (``map_batches`` with an actor that loads the
featuriser once: the MiniLM encoder for ``encoder``, the n-gram hasher for ``fast``); the
featurised rows stay in the object store and stream to the Ray Train workers
(``TorchTrainer``, gloo, DDP when more than one worker); the validation and test rows are
scored by another actor operator, so the driver only ever holds labels and scores, never
the feature matrix. Rank 0 returns the head as a safetensors checkpoint. The caller must
have Ray running (stages never start Ray; the runner does).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch

from atlas.config import Stage3Config
from atlas.stage3.annotators import Annotator, AnnotatorConfig, build_head, featurize
from atlas.stage3.labels import LabelledChunks, split_of

CKPT_FILE = "head.safetensors"
log = logging.getLogger(__name__)


class TrainError(RuntimeError):
    pass


def calibrate_thresholds(scores: np.ndarray, y: np.ndarray, min_positives: int = 1, default: float = 0.5) -> np.ndarray:
    """Per concept, the score cut that maximises F1 on (scores, y); ``default`` when the split
    has fewer than ``min_positives`` positives of the concept (too few to calibrate on)."""
    n, c = scores.shape
    th = np.full(c, default, np.float32)
    for j in range(c):
        p = int(y[:, j].sum())
        if p < min_positives or n == 0:
            continue
        order = np.argsort(-scores[:, j], kind="stable")
        s = scores[order, j]
        tp = np.cumsum(y[order, j])
        k = np.arange(1, n + 1)
        f1 = 2 * tp / (k + p)
        # Only cut between distinct scores, so the threshold separates exactly the top k.
        valid = np.r_[s[:-1] > s[1:], True]
        f1 = np.where(valid, f1, -1)
        best = int(np.argmax(f1))
        below = s[best + 1] if best + 1 < n else max(s[best] - 1e-3, 0.0)
        th[j] = float((s[best] + below) / 2)
    return th


def _train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    from safetensors.torch import save_file

    torch.set_num_threads(config["threads"])
    torch.manual_seed(config["seed"])
    cfg = AnnotatorConfig(**config["annotator"])
    model = ray.train.torch.prepare_model(build_head(cfg))  # DDP over gloo when world size > 1
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    shard = ray.train.get_dataset_shard("train")
    x_dtype = torch.int64 if cfg.kind == "fast" else torch.float32
    for epoch in range(config["epochs"]):
        total, seen = 0.0, 0
        for batch in shard.iter_torch_batches(
            batch_size=config["batch_size"], dtypes={"x": x_dtype, "y": torch.float32},
            local_shuffle_buffer_size=4 * config["batch_size"], local_shuffle_seed=config["seed"] + epoch,
        ):
            opt.zero_grad()
            loss = loss_fn(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            total += float(loss) * len(batch["y"])
            seen += len(batch["y"])
        metrics = {"epoch": epoch, "loss": total / max(seen, 1)}
        last = epoch == config["epochs"] - 1
        rank = ray.train.get_context().get_world_rank()
        if rank == 0:
            log.info("annotator head epoch %d loss %.4f", epoch, metrics["loss"])
        # One report, at the end: each ray.train.report is a ~2 s barrier on 2 cores, more than
        # an epoch of this small head (25 epochs: 67 s -> 21 s).
        if last and rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                head = model.module if hasattr(model, "module") else model
                save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, os.path.join(tmp, CKPT_FILE))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        elif last:
            ray.train.report(metrics)


class FeaturizeBatch:
    """Ray Data actor: featuriser loaded once per actor (model weights for ``encoder``)."""

    def __init__(self, annotator: dict[str, Any], threads: int = 1):
        torch.set_num_threads(threads)
        self.cfg = AnnotatorConfig(**annotator)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = featurize(self.cfg, [str(t) for t in batch["text"]])
        return {"row": batch["row"], "split": batch["split"], "x": x, "y": batch["y"]}


class ScoreBatch:
    """Ray Data actor: the trained head (state dict) scoring featurised rows outside ``train``."""

    def __init__(self, annotator: dict[str, Any], state: dict[str, np.ndarray], threads: int = 1):
        torch.set_num_threads(threads)
        cfg = AnnotatorConfig(**annotator)
        head = build_head(cfg)
        head.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        self.ann = Annotator(cfg, head)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        held = batch["split"] != "train"
        x = batch["x"][held]
        return {"row": batch["row"][held], "scores": self.ann.scores_from_features(np.ascontiguousarray(x))}


def _train_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    keep = batch["split"] == "train"
    return {"x": batch["x"][keep], "y": batch["y"][keep].astype(np.float32)}


def featurized_dataset(cfg: AnnotatorConfig, texts: list[str], y: np.ndarray, split: np.ndarray, s3: Stage3Config):
    """Ray Dataset (row, split, x, y) of the labelled chunks, featurised by actors, materialised in the object store."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    src = pa.table({
        "row": pa.array(np.arange(len(texts)), pa.int64()), "split": pa.array(split.astype(str)), "text": pa.array(texts, pa.string()),
        "y": ArrowTensorArray.from_numpy(np.ascontiguousarray(y, np.uint8)),
    })
    blocks = max(1, min(64, len(texts) // 512))
    ds = ray.data.from_arrow(src).repartition(blocks)
    return ds.map_batches(
        FeaturizeBatch, fn_constructor_kwargs={"annotator": dataclasses.asdict(cfg), "threads": max(1, int(s3.cpus_per_actor))},
        batch_size=s3.inference_batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=s3.actors), num_cpus=s3.cpus_per_actor,
    ).materialize()


def fit_head(cfg: AnnotatorConfig, feats: Any, s3: Stage3Config) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train the head of ``cfg`` on the ``train`` rows of ``feats`` (see :func:`featurized_dataset`) with Ray Train.

    Ray Train's run directory (its checkpoint) is temporary: the head is returned and saved
    by the caller, so nothing is left behind in the temp folder.
    """
    with tempfile.TemporaryDirectory(prefix="atlas-stage3-train-") as storage_path:
        return _fit_head(cfg, feats, s3, storage_path)


def _fit_head(cfg: AnnotatorConfig, feats: Any, s3: Stage3Config, storage_path: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer
    from safetensors.torch import load_file

    # Materialised once (object store): every epoch re-reads these blocks instead of re-running the filter.
    ds = feats.map_batches(_train_rows, batch_format="numpy").materialize()
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={
            "annotator": {**cfg.__dict__},
            "epochs": s3.epochs, "lr": s3.learning_rate, "batch_size": s3.batch_size, "seed": s3.seed,
            "threads": max(1, int(s3.cpus_per_train_worker)),
        },
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=s3.train_workers, resources_per_worker={"CPU": s3.cpus_per_train_worker}),
        run_config=ray.train.RunConfig(name=f"stage3-{cfg.kind}-{int(time.time())}", storage_path=storage_path),
        datasets={"train": ds},
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    if result.error is not None:
        raise TrainError(f"annotator training failed: {result.error}")
    if result.checkpoint is None:
        raise TrainError("annotator training returned no checkpoint")
    with result.checkpoint.as_directory() as d:
        state = load_file(os.path.join(d, CKPT_FILE))
    head = build_head(cfg)
    head.load_state_dict(state)
    return head, {"train_seconds": round(time.perf_counter() - t0, 2), "final_loss": (result.metrics or {}).get("loss"), "workers": s3.train_workers}


def held_out_scores(ann: Annotator, feats: Any, n_rows: int, s3: Stage3Config) -> np.ndarray:
    """(n_rows, n_concepts) scores of every non-train row of ``feats`` (NaN on train rows), scored by actors."""
    import ray.data

    state = {k: v.detach().cpu().numpy() for k, v in ann.head.state_dict().items()}
    scored = feats.map_batches(
        ScoreBatch, fn_constructor_kwargs={"annotator": dataclasses.asdict(ann.cfg), "state": state, "threads": max(1, int(s3.cpus_per_actor))},
        batch_size=4096, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=s3.actors), num_cpus=s3.cpus_per_actor,
    )
    out = np.full((n_rows, ann.cfg.n_concepts), np.nan, np.float32)
    for b in scored.iter_batches(batch_size=4096, batch_format="numpy"):  # labelled rows only: n x concepts floats
        out[b["row"]] = b["scores"]
    return out


def annotator_config(kind: str, data: LabelledChunks, s3: Stage3Config) -> AnnotatorConfig:
    return AnnotatorConfig(
        kind=kind, concept_ids=list(data.concept_ids), library_version=data.library_version,
        max_concepts_per_chunk=s3.max_concepts_per_chunk, hash_buckets=s3.hash_buckets, hash_dim=s3.hash_dim,
        word_ngrams=s3.word_ngrams, max_features=s3.max_features, char_ngrams=s3.char_ngrams, encoder_model=s3.encoder_model,
    )


def train_annotator(kind: str, data: LabelledChunks, s3: Stage3Config) -> tuple[Annotator, dict[str, Any]]:
    """Train one annotator on the 'train' split, calibrate thresholds on 'val'.

    Returns the annotator and a dict with the split labels (per chunk), ``test_scores``
    (the annotator's scores of the 'test' rows, in chunk order: what
    :mod:`atlas.stage3.evaluate` scores against the teacher) and statistics.
    """
    cfg = annotator_config(kind, data, s3)
    split = split_of(data.chunk_ids, s3.val_fraction, s3.test_fraction, s3.seed)
    train, val, test = split == "train", split == "val", split == "test"
    if not train.any():
        raise TrainError("no training chunks (every labelled chunk fell in the validation/test splits?)")
    t0 = time.perf_counter()
    feats = featurized_dataset(cfg, data.texts, data.y, split, s3)
    feat_s = time.perf_counter() - t0
    if cfg.kind == "encoder":
        cfg.embed_dim = int(np.asarray(feats.take(1)[0]["x"]).shape[-1])
    head, stats = fit_head(cfg, feats, s3)
    ann = Annotator(cfg, head)
    scores = held_out_scores(ann, feats, len(data), s3)
    th = calibrate_thresholds(scores[val], data.y[val], min_positives=s3.calibration_min_positives)
    # Concepts the teacher used too rarely get a threshold above 1: never predicted.
    support = data.y[train].sum(0) + data.y[val].sum(0)
    th[support < s3.min_concept_chunks] = 1.01
    cfg.thresholds = [float(t) for t in th]
    stats.update(
        kind=kind, featurize_seconds=round(feat_s, 2), n_train=int(train.sum()), n_val=int(val.sum()), n_test=int(test.sum()),
        n_concepts=cfg.n_concepts, concepts_never_predicted=int((support < s3.min_concept_chunks).sum()),
    )
    cfg.train_stats = stats
    return ann, {"split": split, "test_scores": scores[test], "stats": stats}

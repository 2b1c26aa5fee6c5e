"""Distributed Steerling training: Ray Train ``TorchTrainer`` workers running DeepSpeed.

``train(model_cfg, train_cfg, data, out) -> TrainResult`` is the same protocol as the
single-process ``model.loop.train``; ``data`` is a ``DataConfig`` (annotation shards), a
dict for one, a URI of an Atlas run / shard folder, or a raw text corpus (which is first
turned into STAND-IN annotation shards, see ``model.data.standin_annotations``).

Each worker builds the model, hands it and a torch AdamW to ``deepspeed.initialize``
(a client optimizer: no fused-op compilation), and runs ``compute_losses`` ->
``engine.backward`` -> ``engine.step`` with DeepSpeed doing gradient accumulation,
clipping, the ZeRO partitioning of optimizer state (stage 1/2) and the LR schedule
(``model.loop.lr_at`` through a LambdaLR). CPU: ``DS_ACCELERATOR=cpu``, gloo and (where the CPU
computes bf16 natively) bf16 autocast; GPU: NCCL and bf16.

Checkpoints (every ``checkpoint_every`` steps and at the end) go through
``ray.train.report`` into the run's storage (local or S3 via a pyarrow filesystem). Files
are safe to load: ``model.safetensors`` (rank 0; ZeRO 1/2 keep full weights on every rank),
``optim-rank<r>.safetensors`` + ``optim-rank<r>.json`` (each rank's optimizer partition)
and ``state.json`` (step, data position, metric history). A restarted worker group
(``FailureConfig``) or a new ``train`` call with the same ``out`` resumes from the latest
checkpoint. Outputs under ``out``:

    model/                 safetensors + config + tokenizer + concepts (load_pretrained)
    metrics/steps.parquet  per-step losses, lr, grad norm, tokens/s, step and data-wait seconds
    metrics/eval.parquet   held-out val loss, the four interpretability metrics, concept AUC (+ base-rate control)
    metrics/loss_curves.png
    _manifest.json         configs, data provenance (annotation run, concept library), timings
    ray/<name>/            Ray Train run storage (checkpoints)
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from model.config import ModelConfig, TrainConfig
from model.data import DataConfig
from model.loop import TrainResult

log = logging.getLogger("atlas.train")

__all__ = ["DistConfig", "FaultInjection", "TrainJobConfig", "train", "run_job", "load_job_config"]


class FaultInjection(BaseModel):
    """Test hook: rank ``rank`` calls ``os._exit(1)`` before step ``step`` once (a marker
    file at ``marker`` records that it fired, so the restarted group runs through)."""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0)
    rank: int = Field(1, ge=0)
    marker: str
    # the controller collects reported checkpoints by polling (every ~2 s); a worker that
    # dies right after ray.train.report can take that report with it
    delay_s: float = Field(8.0, ge=0)


class DistConfig(BaseModel):
    """How the run is spread over Ray Train workers and DeepSpeed."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(1.0, gt=0)
    threads_per_worker: int | None = Field(1, ge=1, description="torch threads per worker (CPU)")
    zero_stage: Literal[0, 1, 2] = 1
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0: only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    max_failures: int = Field(2, ge=0, description="worker-group restarts from the latest checkpoint")
    log_every: int = Field(1, ge=1)
    name: str = Field("steerling", description="Ray Train run name (same name + out resumes)")
    s3_endpoint: str | None = None
    fault: FaultInjection | None = None


class TrainJobConfig(BaseModel):
    """One training job (the YAML read by ``atlas train --config``)."""

    model_config = ConfigDict(extra="forbid")

    output: str
    preset: str | None = Field("tiny", description="ModelConfig preset; `model` fields override it")
    model: dict[str, Any] = Field(default_factory=dict)
    train: dict[str, Any] = Field(default_factory=lambda: {"steps": 100})
    data: DataConfig
    dist: DistConfig = Field(default_factory=DistConfig)
    n_known_from_library: bool = Field(True, description="set model.n_known to the concept library size")


# ----------------------------------------------------------------------------- worker side
def _seed_for(seed: int, rank: int, step: int, micro: int) -> int:
    # independent masking noise per (rank, step, micro-batch), reproducible after a resume
    return (seed * 1_000_003 + rank * 10_007 + step * 101 + micro) % (2**63 - 1)


def _optimizer_partition(engine):
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(opt, attr):
            return getattr(opt, attr), opt.optimizer
    return None, opt  # stage 0, fp32: DeepSpeed keeps the client optimizer as is


def optimizer_state_numel(engine) -> int:
    """Elements of Adam moments held by this rank (what ZeRO partitions)."""
    _, inner = _optimizer_partition(engine)
    return sum(v.numel() for st in inner.state.values() for k, v in st.items() if k == "exp_avg")


def weights_digest(module) -> str:
    """sha256 over the module's tensors (names + bytes): equal digests, identical weights."""
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _save_optimizer(engine, d: Path, rank: int) -> None:
    from safetensors.torch import save_file

    parts, inner = _optimizer_partition(engine)
    sd = inner.state_dict()
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state_keys": {}}
    for pid, st in sd["state"].items():
        meta["state_keys"][str(pid)] = sorted(st)
        for k, v in st.items():
            tensors[f"state.{pid}.{k}"] = v.detach().cpu().contiguous().reshape(v.shape)
    for i, p in enumerate(parts or []):
        tensors[f"fp32_partition.{i}"] = p.detach().cpu().contiguous()
    save_file(tensors, str(d / f"optim-rank{rank}.safetensors"))
    (d / f"optim-rank{rank}.json").write_text(json.dumps(meta, default=list))


def _load_optimizer(engine, d: Path, rank: int) -> None:
    import torch
    from safetensors.torch import load_file

    f = d / f"optim-rank{rank}.safetensors"
    if not f.exists():
        raise FileNotFoundError(f"checkpoint {d} has no optimizer state for rank {rank} "
                                "(resuming needs the same number of workers)")
    tensors = load_file(str(f))
    meta = json.loads((d / f"optim-rank{rank}.json").read_text())
    parts, inner = _optimizer_partition(engine)
    with torch.no_grad():
        for i, p in enumerate(parts or []):
            src = tensors[f"fp32_partition.{i}"]
            if src.shape != p.shape:
                raise ValueError(f"checkpoint {d}: rank {rank} partition {i} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(p.shape)} (different world size or model)")
            p.copy_(src)
    state = {int(pid): {k: tensors[f"state.{pid}.{k}"] for k in keys} for pid, keys in meta["state_keys"].items()}
    inner.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _worker(config: dict) -> None:
    """``train_loop_per_worker``: runs on every Ray Train worker."""
    use_gpu = config["dist"]["use_gpu"]
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_gpu else "cpu")  # before deepspeed is imported
    import deepspeed
    import deepspeed.ops
    import ray.data
    import ray.train
    import torch
    import torch.distributed as dist

    from model.data import iter_batches
    from model.io import save_pretrained
    from model.loop import autocast_factory, lr_at, make_optimizer, resolve_dtype
    from model.metrics import evaluate
    from model.modeling import Steerling
    from model.objectives import compute_losses

    # DeepSpeed's CPU shared-memory all-reduce is a JIT-compiled C++ op used for inference;
    # training collectives go through gloo, so skip the compilation
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    mcfg = ModelConfig.model_validate(config["model_cfg"])
    tcfg = TrainConfig.model_validate(config["train_cfg"])
    dcfg = DistConfig.model_validate(config["dist"])
    ray.data.DataContext.get_current().enable_progress_bars = False
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if dcfg.threads_per_worker and not use_gpu:
        torch.set_num_threads(dcfg.threads_per_worker)
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if use_gpu else "cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    # tcfg.dtype "auto" is bf16 where the device computes it natively. The forward runs under its
    # autocast; on GPU also DeepSpeed's bf16 mode (bf16 weights, fp32 master copy), while CPU workers
    # keep fp32 weights, gradients and optimizer (DeepSpeed's bf16 optimizer targets accelerators).
    compute_dtype = resolve_dtype(tcfg.dtype, device.type)
    autocast = autocast_factory(compute_dtype, device.type)
    ds_bf16 = use_gpu and compute_dtype == "bf16"
    micro = tcfg.batch_size // (world * dcfg.grad_accum)
    total = tcfg.total_steps

    torch.manual_seed(tcfg.seed)
    model = Steerling(mcfg)
    state = {"step": 0, "consumed": 0, "steps": [], "evals": [], "restarts": 0}
    ckpt = ray.train.get_checkpoint()
    ckpt_dir = None
    if ckpt is not None:
        from safetensors.torch import load_file

        ckpt_dir = Path(tempfile.mkdtemp(prefix="steerling-restore-"))
        ckpt.to_directory(str(ckpt_dir))
        model.load_state_dict(load_file(str(ckpt_dir / "model.safetensors")), strict=True)
        state = json.loads((ckpt_dir / "state.json").read_text())
        state["restarts"] = state.get("restarts", 0) + 1
    model.to(device)
    opt = make_optimizer(model, tcfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, tcfg, total) / tcfg.lr)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": dcfg.grad_accum,
        "gradient_clipping": tcfg.grad_clip or 0.0,
        "zero_optimization": {"stage": dcfg.zero_stage},
        "zero_allow_untested_optimizer": True,  # the client AdamW (no DeepSpeed fused op)
        "bf16": {"enabled": ds_bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_cfg)
    if ckpt_dir is not None:
        _load_optimizer(engine, ckpt_dir, rank)
        engine.lr_scheduler.load_state_dict({**engine.lr_scheduler.state_dict(), "last_epoch": state["step"],
                                             "_step_count": state["step"] + 1})
        engine.global_steps = state["step"]
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        state.setdefault("restores", []).append({"step": state["step"], "attempt": state["restarts"],
                                                 "saved_digest": state.get("weights_digest"),
                                                 "restored_digest": weights_digest(engine.module)})
    n_params = sum(p.numel() for p in model.parameters())
    opt_numel = optimizer_state_numel(engine) if state["step"] or ckpt_dir else None

    n_known = mcfg.n_known if mcfg.has_concepts else None
    train_it = ray.train.get_dataset_shard("train")
    val_batches = []
    if rank == 0:
        from model.data import collate

        vr = config["val_rows"]
        for a in range(0, len(vr["n_spans"]) - micro + 1, micro):
            b = collate({k: v[a:a + micro] for k, v in vr.items()}, n_known)
            val_batches.append({k: v.to(device) for k, v in b.items()})

    def batches():
        epoch, seen = 0, 0
        while True:
            got = False
            for b in iter_batches(train_it, micro, n_known, seed=tcfg.seed + epoch + 1000 * rank,
                                  shuffle_buffer=config["shuffle_buffer"]):
                got = True
                seen += 1
                if seen <= state["consumed"]:  # resume: skip what the checkpointed run used
                    continue
                yield b
            if not got:
                raise ValueError(f"rank {rank}: the training split yields no batch of {micro} sequences")
            epoch += 1

    def do_eval(step: int) -> None:
        if rank != 0:  # ZeRO <= 2: forward needs no collective, so one rank evaluates
            return
        rec = {"step": step, "tokens": step * tcfg.tokens_per_step,
               **evaluate(engine.module, val_batches, tcfg, autocast=autocast)}
        state["evals"].append(rec)
        print(json.dumps({"event": "eval", **rec}), flush=True)

    def checkpoint(step: int, metrics: dict) -> None:
        d = Path(tempfile.mkdtemp(prefix="steerling-ckpt-"))
        _save_optimizer(engine, d, rank)
        if rank == 0:
            save_pretrained(engine.module, d, metadata={"step": step})
            state["weights_digest"] = weights_digest(engine.module)
            (d / "state.json").write_text(json.dumps({**state, "step": step}, default=float))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(d)),
                         checkpoint_dir_name=f"step-{step:08d}")
        shutil.rmtree(d, ignore_errors=True)

    if state["step"] == 0 and not state["evals"]:
        do_eval(0)
    it = batches()
    step = state["step"]
    tokens_step = tcfg.tokens_per_step
    while step < total:
        f = dcfg.fault
        if f is not None and step == f.step and rank == f.rank and not os.path.exists(f.marker):
            Path(f.marker).write_text(f"rank {rank} exited at step {step}")
            time.sleep(f.delay_s)
            os._exit(1)  # a lost worker, as far as Ray Train can tell
        t0 = time.perf_counter()
        acc = {"loss": 0.0, "lm_loss": 0.0, "concept_loss": 0.0}
        data_s = 0.0
        for m in range(dcfg.grad_accum):
            td = time.perf_counter()
            batch = {k: v.to(device, non_blocking=True) for k, v in next(it).items()}
            data_s += time.perf_counter() - td
            state["consumed"] += 1
            gen = torch.Generator(device=device).manual_seed(_seed_for(tcfg.seed, rank, step, m))
            with autocast():
                out = compute_losses(engine.module, batch, tcfg, step, total, gen)
            engine.backward(out["loss"])
            engine.step()
            for k in acc:
                if k in out:
                    acc[k] += float(out[k]) / dcfg.grad_accum
        red = torch.tensor([acc["loss"], acc["lm_loss"], acc["concept_loss"]], dtype=torch.float64)
        dist.all_reduce(red)  # mean over ranks: the loss of the whole global batch
        red /= world
        dt = time.perf_counter() - t0
        gn = engine.get_global_grad_norm()
        rec = {"step": step, "loss": float(red[0]), "lm_loss": float(red[1]),
               "concept_loss": float(red[2]) if mcfg.has_concepts else None,
               "lr": float(engine.get_lr()[0]), "grad_norm": float(gn) if gn is not None else None,
               "tokens_per_s": tokens_step / dt, "step_s": dt, "data_s": data_s, "attempt": state["restarts"]}
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"non-finite loss at step {step}: {rec}")
        if opt_numel is None:
            opt_numel = optimizer_state_numel(engine)
        step += 1
        if rank == 0:
            state["steps"].append(rec)
            if step % dcfg.log_every == 0 or step == total:
                print(json.dumps({"event": "train_step", **rec}), flush=True)
        if tcfg.eval_every and step % tcfg.eval_every == 0 and step < total:
            do_eval(step)
        if step == total or (dcfg.checkpoint_every and step % dcfg.checkpoint_every == 0):
            if step == total:
                do_eval(step)
            metrics = {"step": step, "loss": rec["loss"], "lm_loss": rec["lm_loss"], "rank": rank,
                       "engine": type(engine).__name__, "optimizer": type(engine.optimizer).__name__,
                       "zero_stage": engine.zero_optimization_stage(), "opt_state_numel": opt_numel,
                       "n_params": n_params, "world_size": world, "restarts": state["restarts"],
                       "compute_dtype": compute_dtype}
            state["step"] = step
            checkpoint(step, metrics)


# ----------------------------------------------------------------------------- driver side
def _as_data_config(data, out_loc, mcfg: ModelConfig, s3_endpoint: str | None) -> DataConfig:
    if isinstance(data, DataConfig):
        return data
    if isinstance(data, dict):
        return DataConfig.model_validate(data)
    if isinstance(data, (list, tuple)) or (isinstance(data, (str, os.PathLike)) and _is_text_corpus(str(data))):
        # STAND-IN: raw text has no Atlas labels yet; label it with model/labels.py
        from model.data import standin_annotations, write_annotation_run

        ann, con = standin_annotations(data if isinstance(data, (list, tuple)) else str(data), max(1, mcfg.n_known))
        uri = write_annotation_run(out_loc.join("standin-annotations").uri, ann, con, s3_endpoint=s3_endpoint)
        return DataConfig(annotations=uri, s3_endpoint=s3_endpoint)
    return DataConfig(annotations=str(data), s3_endpoint=s3_endpoint)


def _is_text_corpus(p: str) -> bool:
    path = Path(p)
    return (path.is_file() and path.suffix == ".txt") or (path.is_dir() and any(path.glob("*.txt")))


def _upload_dir(local: Path, dest) -> None:
    import pyarrow.fs as pafs

    dest.fs.create_dir(dest.path, recursive=True)
    pafs.copy_files(str(local), dest.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dest.fs)


def _write_parquet(rows: list[dict], loc) -> None:
    import polars as pl
    import pyarrow.parquet as pq

    df = pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()
    pq.write_table(df.to_arrow(), loc.path, filesystem=loc.fs)


def plot_loss_curves(steps: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    s = [r["step"] + 1 for r in steps]
    axes[0].plot(s, [r["lm_loss"] for r in steps], label="train LM loss")
    if steps and steps[0].get("concept_loss") is not None:
        axes[0].plot(s, [r["concept_loss"] for r in steps], label="train concept loss")
    if evals:
        axes[0].plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="val LM loss")
    if evals and "concept_loss" in evals[0]:
        axes[0].plot([e["step"] for e in evals], [e["concept_loss"] for e in evals], "s-", label="val concept loss")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].set_yscale("log")  # the concept loss starts an order of magnitude above the LM loss
    axes[0].legend(fontsize=7)
    for k in ("concept_independence_loss", "concept_contribution", "concept_auc"):
        if evals and k in evals[0]:
            axes[1].plot([e["step"] for e in evals], [e.get(k) for e in evals], "o-", label=f"val {k}")
    axes[1].set_xlabel("step")
    axes[1].set_title("held-out interpretability metrics")
    if axes[1].lines:
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data, out=None, progress: bool = True,
          dist: DistConfig | dict | None = None, tokenizer=None, **_ignored) -> TrainResult:
    """Train with Ray Train + DeepSpeed; same protocol as ``model.loop.train``.

    Needs a connected Ray (``atlas.cluster.ray_session``); ``out`` is a local path or an
    s3:// URI (a temporary folder when None). Raises with the worker's error on failure.
    """
    import ray
    import ray.train
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from atlas import storage
    from atlas.config import StorageConfig
    from atlas.manifest import package_versions
    from model.data import prepare
    from model.flops import count_params, train_flops
    from model.io import load_pretrained
    from model.metrics import concept_rank_alignment

    t0 = time.perf_counter()
    dcfg = dist if isinstance(dist, DistConfig) else DistConfig.model_validate(dist or {})
    tcfg, mcfg = train_cfg, model_cfg
    world = dcfg.num_workers
    if tcfg.batch_size % (world * dcfg.grad_accum):
        raise ValueError(f"batch_size {tcfg.batch_size} must be divisible by num_workers x grad_accum "
                         f"= {world} x {dcfg.grad_accum}")
    if tcfg.seq_len > mcfg.max_seq_len:
        raise ValueError(f"seq_len {tcfg.seq_len} > model max_seq_len {mcfg.max_seq_len}")
    if mcfg.is_diffusion and tcfg.seq_len % mcfg.block_size:
        raise ValueError(f"seq_len {tcfg.seq_len} must be a multiple of block_size {mcfg.block_size}")
    if not ray.is_initialized():
        raise RuntimeError("model.train.train needs a connected Ray: wrap it in atlas.cluster.ray_session(...)")
    out = out or tempfile.mkdtemp(prefix="steerling-run-")
    scfg = StorageConfig(s3_endpoint=dcfg.s3_endpoint)
    out_loc = storage.resolve(str(out), scfg)
    dcfg_data = _as_data_config(data, out_loc, mcfg, dcfg.s3_endpoint)
    prep = prepare(dcfg_data, tcfg.seq_len, tcfg.seed, mcfg.n_known if mcfg.has_concepts else None,
                   mcfg.vocab_size, tokenizer)
    names = (prep.concept_names + [""] * (mcfg.n_known - prep.n_concepts)) if mcfg.has_concepts else None
    prep_s = time.perf_counter() - t0

    # the held-out batches are small and fixed: take them once here, so the workers run
    # only the training stream (a second Ray Data execution would compete for the CPUs
    # left over by the workers) and every restart evaluates on the same sequences
    n_val = tcfg.eval_batches * (tcfg.batch_size // (world * dcfg.grad_accum))
    val_rows = prep.val.take_batch(n_val, batch_format="numpy") if n_val else {}
    if len(val_rows.get("n_spans", [])) < n_val:
        raise ValueError(f"validation split has {len(val_rows.get('n_spans', []))} packed sequences, "
                         f"need {n_val} (eval_batches x micro batch); raise data.val_fraction")
    val_rows = {k: v for k, v in val_rows.items() if k != "span_chunks"}
    ray_storage = out_loc.join("ray")
    ray_storage.fs.create_dir(ray_storage.path, recursive=True)
    run_cfg = RunConfig(
        name=dcfg.name,
        storage_path=ray_storage.path,
        storage_filesystem=ray_storage.fs if out_loc.is_s3 else None,
        failure_config=FailureConfig(max_failures=dcfg.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=dcfg.keep_checkpoints),
    )
    resources = {"CPU": dcfg.cpus_per_worker}
    if dcfg.use_gpu:
        resources["GPU"] = dcfg.gpus_per_worker
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"model_cfg": mcfg.model_dump(), "train_cfg": tcfg.model_dump(mode="json"),
                           "dist": dcfg.model_dump(), "shuffle_buffer": dcfg_data.shuffle_buffer,
                           "val_rows": val_rows},
        scaling_config=ScalingConfig(num_workers=world, use_gpu=dcfg.use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if dcfg.use_gpu else "gloo"),
        run_config=run_cfg,
        datasets={"train": prep.train},
    )
    if progress:
        print(json.dumps({"event": "train_start", "steps": tcfg.total_steps, "workers": world,
                          "zero_stage": dcfg.zero_stage, "concepts": prep.n_concepts, "output": out_loc.uri,
                          "per_step_logs": "Ray worker logs (train_step / eval JSON lines)"}), flush=True)
    t1 = time.perf_counter()
    result = trainer.fit()
    train_s = time.perf_counter() - t1
    if result.error is not None:
        raise RuntimeError(f"Steerling training failed: {result.error}") from result.error
    if result.checkpoint is None:
        raise RuntimeError("Steerling training finished without a checkpoint")

    with tempfile.TemporaryDirectory(prefix="steerling-final-") as tmp:
        ck = Path(tmp) / "ckpt"
        result.checkpoint.to_directory(str(ck))
        state = json.loads((ck / "state.json").read_text())
        model, _, _ = load_pretrained(ck)
        from model.io import save_pretrained

        mdir = Path(tmp) / "model"
        save_pretrained(model, mdir, prep.tokenizer, names,
                        metadata={"steps": state["step"], "tokens": state["step"] * tcfg.tokens_per_step})
        mdir_loc = out_loc.join("model")
        _upload_dir(mdir, mdir_loc)
        met = Path(tmp) / "metrics"
        met.mkdir()
        plot_loss_curves(state["steps"], state["evals"], met / "loss_curves.png")
        metrics_loc = out_loc.join("metrics")
        _upload_dir(met, metrics_loc)
        _write_parquet(state["steps"], metrics_loc.join("steps.parquet"))
        _write_parquet(state["evals"], metrics_loc.join("eval.parquet"))

    total = tcfg.total_steps
    tokens = total * tcfg.tokens_per_step
    last = state["evals"][-1] if state["evals"] else {}
    steps = state["steps"]
    tail = steps[-max(1, len(steps) // 10):]
    done_steps = [r for r in steps if r.get("attempt", 0) == state.get("restarts", 0)] or steps
    step_time = sum(r["step_s"] for r in done_steps)
    final = {
        **{k: v for k, v in last.items() if k not in ("step", "tokens")},
        "train_loss": float(sum(r["lm_loss"] for r in tail) / max(1, len(tail))),
        "tokens_seen": tokens, "steps": total,
        "params": count_params(mcfg)["non_embedding"], "params_total": count_params(mcfg)["total"],
        "flops": train_flops(mcfg, tokens, tcfg.seq_len),
        "wall_s": time.perf_counter() - t0, "train_s": train_s, "prep_s": prep_s,
        "tokens_per_s": len(done_steps) * tcfg.tokens_per_step / max(step_time, 1e-9),
        # rank 0's wait for its micro-batches (step 0's includes the input pipeline's start-up);
        # beyond that near 0 unless the Ray Data input is the bottleneck
        "data_wait_share": sum(r.get("data_s", 0.0) for r in done_steps) / max(step_time, 1e-9),
        "restarts": state.get("restarts", 0),
    }
    if names is not None and any(names):
        # chance-calibrated rank proxy; the paper's judged 1-5 alignment needs a judge
        ra = concept_rank_alignment(model, prep.tokenizer, names)
        final["concept_rank_alignment"] = ra["rank_alignment"]
        final["concept_rank_hit_at_20"] = ra["hit_at_k"]
    manifest = {
        "kind": "steerling_train", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_uri": mdir_loc.uri, "metrics_uri": metrics_loc.uri,
        "checkpoint_uri": getattr(result.checkpoint, "path", None),
        "data": {**prep.provenance, **{k: v for k, v in prep.stats.items()}},
        "concept_library": {"version": prep.provenance.get("library_version"),
                            "concepts_version": prep.provenance.get("concepts_version"),
                            "n_concepts": prep.n_concepts},
        "annotation_run": {"run_id": prep.provenance.get("annotation_run_id"),
                           "table_version": prep.provenance.get("annotations_version"),
                           "annotator": prep.provenance.get("annotator")},
        "model_config": mcfg.model_dump(), "train_config": tcfg.model_dump(mode="json"),
        "dist_config": dcfg.model_dump(exclude={"fault"}), "data_config": dcfg_data.model_dump(),
        "final": final, "packages": package_versions(),
        "last_report": dict(result.metrics or {}), "restores": state.get("restores", []),
        "final_digest": state.get("weights_digest"),
    }
    storage.write_json_atomic(out_loc.join(storage.MANIFEST), manifest)
    # structured logs (JSON lines with atlas.logs.setup(log_file)): one event per evaluation
    for rec in state["evals"]:
        log.info("steerling eval", extra={"kind": "eval", **rec})
    log.info("steerling trained", extra={"kind": "train_done", "model": mdir_loc.uri, "metrics": metrics_loc.uri,
                                         **{k: v for k, v in final.items() if isinstance(v, (int, float))}})
    if progress:
        print(json.dumps({"event": "train_done", "model": mdir_loc.uri, "metrics": metrics_loc.uri,
                          "val_loss": final.get("val_loss"), "steps": total}), flush=True)
    return TrainResult(final=final, history=state["evals"], checkpoint=mdir_loc.uri, model=model,
                       tokenizer=prep.tokenizer, concept_names=names)


# ----------------------------------------------------------------------------- jobs
def load_job_config(path: str | None, overrides: list[str] | None = None, **fields) -> TrainJobConfig:
    """YAML -> TrainJobConfig, with ``a.b=value`` overrides (the atlas run-config rules)."""
    import yaml

    from atlas.config import ConfigError, apply_overrides

    data = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
    data = apply_overrides(data, list(overrides or []))
    data.update({k: v for k, v in fields.items() if v is not None})
    from pydantic import ValidationError

    try:
        return TrainJobConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, x['loc']))}: {'unknown key' if x['type'] == 'extra_forbidden' else x['msg']}"
                 for x in e.errors()]
        raise ConfigError(f"invalid train config ({path or 'defaults'}):\n" + "\n".join(lines)) from None


def build_configs(job: TrainJobConfig, n_concepts: int | None = None) -> tuple[ModelConfig, TrainConfig]:
    """Model and train configs of a job; the known-concept slots follow the library size."""
    from model.config import PRESETS

    m = dict(job.model)
    if n_concepts is not None and job.n_known_from_library and "n_known" not in m:
        m["n_known"] = max(n_concepts, 1)
        base_topk = m.get("topk_known", PRESETS.get(job.preset or "", {}).get("topk_known", 4))
        m["topk_known"] = min(base_topk, m["n_known"])
    mcfg = ModelConfig.preset(job.preset, **m) if job.preset else ModelConfig.model_validate(m)
    return mcfg, TrainConfig.model_validate(job.train)


def library_size(data: DataConfig) -> int | None:
    """Concepts in the library the shards refer to (None when it has to be scanned)."""
    from model.data import _read_concepts, _resolve_shards

    _, root, _ = _resolve_shards(data)
    lib = _read_concepts(data, root)
    return len(lib[0]) if lib else None


def run_job(job: TrainJobConfig, address: str | None = None, num_cpus: int | None = None,
            object_store_mb: int | None = None) -> TrainResult:
    """Connect to Ray (``address`` or a private local cluster) and run one training job."""
    from atlas.cluster import ray_session
    from atlas.config import RayConfig

    n = library_size(job.data)
    mcfg, tcfg = build_configs(job, n)
    with ray_session(RayConfig(address=address, num_cpus=num_cpus, object_store_memory_mb=object_store_mb)):
        return train(mcfg, tcfg, job.data, job.output, dist=job.dist)


def demo_job(output: str, data: str | None = None, overrides: list[str] | None = None) -> TrainJobConfig:
    """A tiny CPU job: 2 workers x ZeRO-1 on annotation shards.

    ``data``: an Atlas run root with real ``annotations`` (`atlas train --demo` passes the
    `atlas demo` output when there is one); None: shards made from the demo corpus by the
    STAND-IN labeller (model/labels.py), marked so in the manifest.
    """
    from atlas.config import apply_overrides

    if data is None:
        from atlas import storage
        from model.data import standin_annotations, write_annotation_run
        from model.sweep import default_corpus

        uri = storage.resolve(output).join("standin-annotations").uri
        ann, con = standin_annotations(default_corpus(), 48)
        data = write_annotation_run(uri, ann, con, run_id="standin-demo")
    raw = {
        "output": output, "preset": "tiny",
        "model": {"max_seq_len": 128},
        "train": {"steps": 80, "batch_size": 8, "seq_len": 128, "dtype": "fp32", "lr": 3e-3, "warmup_steps": 8,
                  "eval_every": 20, "eval_batches": 2},
        "data": {"annotations": data, "val_fraction": 0.1},
        "dist": {"num_workers": 2, "cpus_per_worker": 0.5, "zero_stage": 1, "checkpoint_every": 40},
    }
    return TrainJobConfig.model_validate(apply_overrides(raw, list(overrides or [])))

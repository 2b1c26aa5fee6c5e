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
    expected_score,
    metrics_delta,
    parse_score_text,
    prompts,
    request_hash,
    resolve_model,
    score_text,
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
    # free JSON whitespace changes what a small model writes; it only matters for a JSON answer
    assert base != request_hash("m", "p", Sampling(max_tokens=8, json_schema=prompts.tag_schema(6), json_whitespace=True))
    assert Sampling.from_key(Sampling(max_tokens=8, json_schema={}, json_whitespace=True).key()).json_whitespace
    assert "json_whitespace" not in Sampling(max_tokens=8).key()
    # the schema's property order survives the key (the grammar emits properties in that order)
    obj = {"type": "object", "properties": {"name": {"type": "string"}, "description": {"type": "string"}}}
    assert list(Sampling.from_key(Sampling(max_tokens=8, json_schema=obj).key()).json_schema["properties"]) == ["name", "description"]
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
    assert env["OMP_NUM_THREADS"] == "2"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # would override the engine's exact kv_cache_memory_bytes
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


def test_cpu_kv_cache_size_is_exact_bytes_and_wins_over_the_legacy_variable(monkeypatch):
    from atlas.engine.core import apply_cpu_env, kv_cache_bytes

    assert kv_cache_bytes(EngineConfig(kv_cache_gib=0.4)) == int(0.4 * 2**30)  # was rounded up to 1 GiB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    apply_cpu_env(EngineConfig(kv_cache_gib=0.4))
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ


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
    shared = os.path.commonprefix([j1, j2])  # preamble and text shared; the tag comes last
    assert "Text: Some text.\n" in shared and shared.endswith("tag ") and j1.endswith(": ")
    others = prompts.judge_prompt("Other text.", "tag one")
    for style in prompts.JUDGE_STYLES:  # every style: shared preamble, then text, then tag
        a, b = (prompts.judge_prompt("Some text.", t, style=style) for t in ("tag one", "tag two"))
        c = prompts.judge_prompt("Other text.", "tag one", style=style)
        assert "Text: Some text.\n" in os.path.commonprefix([a, b]) and a.endswith((": ",)), style
        assert len(os.path.commonprefix([a, c])) > 0.8 * len(a) - 40, style
    assert prompts.judge_prompt("Some text.", "tag one", style=prompts.DEFAULT_JUDGE_STYLE) == j1 != others
    with pytest.raises(ValueError, match="unknown judge prompt style 'nope'"):
        prompts.judge_prompt("Some text.", "tag", style="nope")


def test_expected_score_math():
    assert expected_score({"1": 0.0, "2": 0.0, "3": 0.0, "4": 0.0, "5": 1.0}) == 5.0
    assert expected_score({"1": 0.5, "5": 0.5}) == 3.0
    assert expected_score([0.2, 0.2, 0.2, 0.2, 0.2]) == pytest.approx(3.0)
    # renormalised: only the ratios matter
    assert expected_score([1.0, 3.0]) == pytest.approx(1.75) == expected_score([0.1, 0.3])
    assert expected_score({"a": 1.0, "b": 1.0}, values=[0.0, 10.0]) == 5.0
    for bad in ([0.0, 0.0], [-0.1, 1.0], [float("nan"), 1.0], []):
        with pytest.raises(ValueError):
            expected_score(bad)
    with pytest.raises(ValueError, match="not numbers"):
        expected_score({"yes": 1.0, "no": 0.0})
    with pytest.raises(ValueError, match="2 probabilities but 3 values"):
        expected_score([0.5, 0.5], values=[1, 2, 3])


def test_score_sampling_key_and_text_roundtrip():
    choices = tuple(prompts.JUDGE_CHOICES)
    s = Sampling(**prompts.judge_sampling_kwargs())
    assert s.score_choices == choices and s.max_tokens == 1
    assert Sampling.from_key(s.key()) == s
    # the scoring mode is part of the cache key; plain keys are unchanged (old caches stay valid)
    sampled = Sampling(max_tokens=1, choice=choices)
    assert request_hash("m", "p", s) != request_hash("m", "p", sampled)
    assert request_hash("m", "p", s) != request_hash("m", "p", Sampling(max_tokens=1, score_choices=choices[:4]))
    assert "score_choices" not in Sampling(max_tokens=8).key()
    with pytest.raises(ValueError, match="distinct"):
        Sampling(max_tokens=1, score_choices=("1", "1"))
    with pytest.raises(ValueError, match="cannot be combined"):
        Sampling(max_tokens=1, score_choices=("1", "2"), choice=("1", "2"))
    text = score_text(choices, [0.1, 0.2, 0.3, 0.2, 0.2], 0.9)
    probs = parse_score_text(text)
    assert list(probs) == list(choices) and expected_score(probs) == pytest.approx(3.2)
    with pytest.raises(ValueError, match="not a choice-scoring output"):
        parse_score_text('["a tag"]')


def test_score_results_cache_roundtrip(tmp_path):
    """Scoring rows go through the generation cache as text and come back as probabilities."""
    root = resolve(str(tmp_path))
    s = Sampling(**prompts.judge_sampling_kwargs())
    h = request_hash("m", "judge prompt", s)
    probs = [0.05, 0.05, 0.1, 0.3, 0.5]
    GenerationCache(root).put([{"request_hash": h, "model": "m", "text": score_text(s.score_choices, probs, 0.97), "output_tokens": 0, "finish_reason": "score:5"}])
    got = GenerationCache(root).lookup([h])[h]
    back = parse_score_text(got["text"])
    assert [back[c] for c in s.score_choices] == pytest.approx(probs)
    assert expected_score(back) == pytest.approx(4.15)


def test_metrics_delta_rates():
    before = {"vllm:prefix_cache_queries": 100.0, "vllm:prefix_cache_hits": 10.0}
    after = {
        "vllm:prefix_cache_queries": 1100.0,
        "vllm:prefix_cache_hits": 810.0,
        "vllm:request_prefill_time_seconds:sum": 3.0,
        "vllm:request_decode_time_seconds:sum": 1.0,
    }
    d = metrics_delta(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.8) and d["prefill_share"] == pytest.approx(0.75)
    assert metrics_delta({}, {})["prefix_cache_hit_rate"] is None


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
    import vllm.renderers.hf as renderer_hf

    from atlas.engine import VLLMBackend

    # Counts the processor loads of the start (see test_vllm_start_skips_...).
    processor_loads: list[str] = []
    real_get_processor = renderer_hf.cached_get_processor

    def counting_get_processor(name, *args, **kwargs):
        processor_loads.append(str(name))
        return real_get_processor(name, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(renderer_hf, "cached_get_processor", counting_get_processor)
        be = VLLMBackend(gemma_dir, small_engine_cfg(max_model_len=1024))
    be.processor_loads_at_start = processor_loads
    yield be
    be.close()


@pytest.mark.slow
def test_vllm_kv_cache_is_the_configured_fraction_of_a_gib(vllm_backend):
    assert vllm_backend.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 2**29  # small_engine_cfg: 0.5 GiB


@pytest.mark.slow
def test_vllm_start_skips_the_async_tokenizer_pool_and_the_processor_load(vllm_backend):
    """Pins atlas.engine.core._offline_llm_start against the vLLM in use: if vLLM renames what
    it relies on, the engine still starts, ~8 s slower, and this test says why."""
    import vllm.renderers.hf as renderer_hf
    from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin, maybe_make_thread_pool

    tokenizer = vllm_backend.llm.renderer.tokenizer
    assert not isinstance(tokenizer, ThreadSafeHFTokenizerMixin), "the renderer built its deep-copied tokenizer pool"
    assert renderer_hf.maybe_make_thread_pool is maybe_make_thread_pool, "the pool factory was not restored after the start"
    assert vllm_backend.processor_loads_at_start == [], "the chat-template warm-up loaded the AutoProcessor"
    # The engine still tokenizes and detokenizes as before (same ids as the model's tokenizer).
    out = vllm_backend.generate(["The capital of France is"], Sampling(max_tokens=4))[0]
    assert out.error is None and out.text


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


# ------------------------------------------------------------------ choice scoring (judge)


def _judge_prompts():
    texts = demo_chunks(2, 1).column("text").to_pylist()
    return [prompts.judge_prompt(texts[0], "ships"), prompts.judge_prompt(texts[1], "rugby union")]


def _check_scores(res, n):
    assert len(res) == n
    for r in res:
        assert r.error is None, r.error
        assert len(r.probs) == 5 and sum(r.probs) == pytest.approx(1.0, abs=1e-6) and min(r.probs) >= 0
        assert 0 < r.choice_mass <= 1.0 + 1e-6
        back = parse_score_text(r.text)  # the text form carries the same numbers (cache / runner)
        assert [back[c] for c in prompts.JUDGE_CHOICES] == pytest.approx(list(r.probs), abs=1e-5)
        assert 1.0 <= expected_score(back) <= 5.0


@pytest.mark.slow
def test_vllm_and_transformers_score_choices_agree(vllm_backend, gemma_dir):
    """Both backends read P(1..5) at the end of the same prompts and agree on it; a prompt whose
    choices share their first token is refused with a permanent error naming the reason."""
    from atlas.engine import TransformersBackend

    ps = _judge_prompts()
    s = Sampling(**prompts.judge_sampling_kwargs())
    bad = prompts.judge_prompt("Some text.", "tag").rstrip()  # ends in "Score:" -> " 1".." 5" share the space token
    bad_s = Sampling(max_tokens=1, score_choices=tuple(f" {c}" for c in prompts.JUDGE_CHOICES))
    v = vllm_backend.generate(ps, s)
    _check_scores(v, len(ps))
    vb = vllm_backend.generate([bad], bad_s)[0]
    assert vb.permanent and "share their first token" in vb.error
    hf = TransformersBackend(gemma_dir, small_engine_cfg(backend="transformers", batch_size=2, max_model_len=1024))
    t = hf.generate(ps, s)
    _check_scores(t, len(ps))
    for a, b in zip(v, t):  # same model, two implementations (bf16 rounding differs slightly)
        assert list(a.probs) == pytest.approx(list(b.probs), abs=0.05)
        assert a.choice_mass == pytest.approx(b.choice_mass, abs=0.05)
    hb = hf.generate([bad], bad_s)[0]
    assert hb.permanent and "share their first token" in hb.error


# ------------------------------------------------------------------ engine child processes

# A stand-in for vLLM's process tree: a child (like VLLM::EngineCore) that starts a grandchild
# (like VLLM::Worker) which ignores SIGTERM, as a worker stuck in a compute step does.
_TREE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
    "time.sleep(600)"
)


def _start_tree(reaper, timeout: float = 60.0) -> list[int]:
    import time

    subprocess.Popen([sys.executable, "-c", _TREE])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = reaper.scan()
        if len(pids) >= 2:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"process tree did not start: {reaper.scan()}")


def _wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    import time

    import psutil

    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.2)
    return alive


def test_child_reaper_close_kills_stuck_descendants():
    from atlas.engine.core import ChildReaper

    reaper = ChildReaper(poll_s=0.2)
    pids = _start_tree(reaper)
    signalled = reaper.close(grace_s=1.0)
    assert sorted(signalled) == sorted(pids)
    assert _wait_gone(pids) == []
    assert reaper.close() == []  # twice is harmless


def test_engine_children_die_with_their_sigkilled_owner(tmp_path):
    """An owner killed with SIGKILL (a benchmark or notebook process killed by ``timeout`` /
    the OOM killer) runs no cleanup: the watchdog must take its child and SIGTERM-proof
    grandchild with it (without it both live on, re-parented to init)."""
    import signal

    owner = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(REPO / "tests")!r})
        from atlas.engine.core import ChildReaper
        from test_engine import _start_tree
        print(*_start_tree(ChildReaper(poll_s=0.2)), flush=True)
        time.sleep(600)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) >= 2, pids
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    alive = _wait_gone(pids)
    for pid in alive:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert alive == []


def test_engine_children_die_with_a_killed_ray_actor(ray_cluster):
    """An actor process SIGKILLed (OOM killer, a crash) runs no cleanup at all, neither its
    Python code nor Ray's: the watchdog must still take its child and (SIGTERM-proof)
    grandchild with it."""
    import signal

    import ray

    @ray.remote(num_cpus=0)
    class Owner:
        def start(self):
            from atlas.engine.core import ChildReaper

            self.reaper = ChildReaper(poll_s=0.2)  # what VLLMBackend holds while its engine lives
            return os.getpid(), _start_tree(self.reaper)

    owner = Owner.remote()
    actor_pid, pids = ray.get(owner.start.remote(), timeout=120)
    assert len(pids) >= 2 and actor_pid not in pids
    os.kill(actor_pid, signal.SIGKILL)
    try:
        assert _wait_gone([actor_pid, *pids]) == []
    finally:
        ray.kill(owner, no_restart=True)


def test_engine_actor_replaces_an_engine_that_failed():
    """A batch whose engine raises (e.g. vLLM's core died) gets transient errors (not cached),
    the engine is closed, and the next batch starts a fresh one."""
    import pyarrow as pa

    from atlas.engine import EngineActor
    from atlas.engine.core import EngineDead

    actor = EngineActor("unused", EngineConfig(backend="test").model_dump(), model_id="m")
    closed = []

    def batch(prompt: str) -> pa.Table:
        s = Sampling(max_tokens=8).key()
        return pa.table({"key": ["k"], "prompt": [prompt], "sampling": [s], "request_hash": [request_hash("m", prompt, s)]})

    first = actor.server._engine()
    first.close = lambda: closed.append(True)

    def dead(prompts, sampling):
        raise EngineDead("vLLM engine died: EngineDeadError")

    first.generate = dead
    out = actor(batch("Text: lobsters live in the sea"))
    assert "engine failure: EngineDead" in out.column("_a_error")[0].as_py() and closed == [True]
    assert actor.server.backend is None
    out = actor(batch("Text: lobsters live in the sea"))
    assert out.column("_a_error")[0].as_py() is None and actor.server.backend is not None and actor.server.backend is not first


def test_streamed_answers_leave_the_engine_batch_by_batch(ray_cluster):
    """One big input block (a Parquet file read whole) must not become one engine task whose
    answers appear only at its end: blocks are cut to engine.batch_size rows, so answers flow
    per batch (Ray Data's no-progress timeout otherwise fires on a slow engine)."""
    import pyarrow as pa
    import ray.data

    from atlas.engine import stream_generate

    cfg = EngineConfig(backend="test", batch_size=8)
    s = Sampling(max_tokens=8).key()
    req = pa.table({"key": [f"k{i}" for i in range(40)], "prompt": [f"Text: chunk {i}" for i in range(40)], "sampling": [s] * 40})
    ds = ray.data.from_arrow(req)  # a single 40-row block
    out = stream_generate(ds, cfg, "unused", "m").materialize()
    blocks = [ray.get(r) for r in out.to_arrow_refs()]
    assert sorted(b.num_rows for b in blocks) == [8] * 5
    assert sorted(k for b in blocks for k in b.column("key").to_pylist()) == sorted(req.column("key").to_pylist())


def test_engine_session_serves_every_call_from_one_server_until_released(ray_cluster):
    """In a session, calls with the same model and engine config share one engine server (one
    engine load, the same ready time); outside one, each call loads its own; release frees the
    server, the next call loads anew; another model replaces the server rather than joining it;
    leaving the session leaves no server behind."""
    import pyarrow as pa

    from atlas.engine import generate
    from atlas.engine.runner import engine_loads, engine_session, release_engines
    from tests.engine_fixtures import alive_engine_servers, engine_server_processes

    cfg = EngineConfig(backend="test", batch_size=4, cpus_per_replica=0.5)
    s = Sampling(max_tokens=8).key()

    def call(tag: str, model: str = "m"):
        req = pa.table({"key": [f"{tag}{i}" for i in range(6)], "prompt": [f"Text: {tag} lobsters {i}" for i in range(6)], "sampling": [s] * 6})
        answers, stats = generate(req, cfg, model, model)
        assert answers.num_rows == 6 and answers.column("error").null_count == 6
        return stats.engine_ready_at

    alone = [call("a"), call("b")]
    assert alone[0] != alone[1] and engine_loads() == 0
    with engine_session():
        shared = [call("c"), call("d")]
        assert shared[0] == shared[1] and engine_loads() == 1 and engine_server_processes() == 1
        release_engines()
        assert alive_engine_servers() == 0 and engine_loads() == 1
        assert call("e") > shared[0] and engine_loads() == 2
        # Another model frees the current one's server first: one engine held at a time.
        call("f", model="m2")
        assert engine_loads() == 3 and alive_engine_servers(at_most=1) == 1
        assert call("g", model="m2") is not None and engine_loads() == 3
    assert alive_engine_servers() == 0


def test_each_actor_of_a_pipeline_claims_its_own_server(ray_cluster):
    import ray

    from atlas.engine.runner import EngineServer, _claim

    servers = [ray.remote(EngineServer).options(num_cpus=0).remote("m", EngineConfig(backend="test").model_dump()) for _ in range(2)]
    try:
        picks = [_claim(servers, "p1") for _ in range(3)]
        assert picks[0] != picks[1] and picks[2] in servers  # a third actor shares the least claimed
        assert _claim(servers, "p2") == servers[0]  # a new pipeline claims afresh
    finally:
        for a in servers:
            ray.kill(a)

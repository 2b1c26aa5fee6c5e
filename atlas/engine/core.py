"""Generation backends with one interface: vLLM offline engine and transformers ``generate``.

``Backend.generate(prompts, sampling) -> list[Result]`` never raises for a bad row: a prompt
that cannot be served (too long, engine rejection, ...) comes back as a Result with ``error``
set and naming the reason, and the other rows are generated normally.

Choice scoring (``Sampling(score_choices=("1", ..., "5"))``): instead of sampling, the backend
reads the model's next-token distribution at the end of the prompt, keeps the first token of
each choice and renormalises over them (vLLM: ``SamplingParams.logprob_token_ids`` on one
generated token; transformers: the last position's logits). ``Result.probs`` holds the
per-choice probabilities and ``Result.text`` the same as JSON (:func:`score_text`), so the
text-only request cache and the Ray Data runner carry them unchanged; :func:`parse_score_text`
and :func:`expected_score` turn a row back into a score.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from atlas.config import EngineConfig


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters plus an optional output constraint (JSON schema or a choice)."""

    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    frequency_penalty: float = 0.0
    json_schema: dict | None = field(default=None, hash=False)
    choice: tuple[str, ...] | None = None
    # Score these answers by the model's probabilities instead of sampling (see module doc).
    score_choices: tuple[str, ...] | None = None
    # Free whitespace between the JSON tokens of a json_schema answer (off: small models
    # otherwise fill max_tokens with newlines before closing the object).
    json_whitespace: bool = False

    def __post_init__(self) -> None:
        sc = self.score_choices
        if sc is not None:
            if len(sc) < 2 or len(set(sc)) != len(sc) or not all(isinstance(c, str) and c for c in sc):
                raise ValueError(f"score_choices must be >= 2 distinct non-empty strings, got {sc!r}")
            if self.json_schema is not None or self.choice is not None:
                raise ValueError("score_choices cannot be combined with json_schema or choice")

    def key(self) -> str:
        """Canonical JSON text of the parameters (part of the request cache key)."""
        d = asdict(self)
        for k in ("choice", "score_choices"):
            if d[k] is not None:
                d[k] = list(d[k])
        if d["score_choices"] is None:
            del d["score_choices"]  # keys of plain generations stay as they were (caches stay valid)
        if d["json_schema"] is None:
            del d["json_whitespace"]  # only a JSON answer depends on it
        else:
            # As text, in its own key order: the grammar emits object properties in schema
            # order, so sorting them (sort_keys below) would change the answer's shape.
            d["json_schema"] = json.dumps(self.json_schema, separators=(",", ":"))
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> "Sampling":
        d = json.loads(key)
        if isinstance(d.get("json_schema"), str):
            d["json_schema"] = json.loads(d["json_schema"])
        for k in ("choice", "score_choices"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


@dataclass
class Result:
    text: str | None
    output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    # A permanent error is a property of the request itself (e.g. a prompt longer than the
    # context): it is cached like a generation, so a rerun does not start the engine for it.
    permanent: bool = False
    # Choice scoring only: probabilities renormalised over Sampling.score_choices (same order),
    # and the share of the raw next-token probability that fell on those choices.
    probs: tuple[float, ...] | None = None
    choice_mass: float | None = None


class EngineDead(RuntimeError):
    """The engine is gone (its core process died); the backend was closed and must be replaced."""


class ScoreError(ValueError):
    """The prompt / choices cannot be scored by next-token probabilities (names the reason)."""


def score_text(choices: Sequence[str], probs: Sequence[float], mass: float) -> str:
    """The text form of a scoring result (what the cache stores and ``Result.text`` holds)."""
    return json.dumps(
        {"probs": {c: round(float(p), 6) for c, p in zip(choices, probs)}, "mass": round(float(mass), 6)},
        separators=(",", ":"),
    )


def parse_score_text(text: str | None) -> dict[str, float]:
    """``Result.text`` / cached text of a scoring request -> {choice: probability}. Raises
    ValueError naming the problem when the text is not a scoring result."""
    if text is None:
        raise ValueError("no scoring output")
    try:
        d = json.loads(text)
        probs = d["probs"]
        out = {str(k): float(v) for k, v in probs.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"not a choice-scoring output ({type(e).__name__}): {text[:80]!r}") from None
    if not out:
        raise ValueError(f"choice-scoring output has no choices: {text[:80]!r}")
    return out


def expected_score(probs: Mapping[str, float] | Sequence[float], values: Sequence[float] | None = None) -> float:
    """Expected value of a distribution over answers, renormalised.

    ``probs``: {choice: p} (a choice's value is ``float(choice)``, e.g. "1".."5") or a sequence
    of p; ``values``: the value of each entry (default: the choices as numbers, or 1..n for a
    sequence). Probabilities need not sum to one (they are renormalised); negative or
    non-finite entries, an all-zero distribution or a length mismatch raise ValueError.
    """
    if isinstance(probs, Mapping):
        ps = [float(v) for v in probs.values()]
        if values is None:
            try:
                values = [float(k) for k in probs]
            except ValueError:
                raise ValueError(f"choices {list(probs)} are not numbers; pass values=") from None
    else:
        ps = [float(v) for v in probs]
        if values is None:
            values = [float(i + 1) for i in range(len(ps))]
    if len(values) != len(ps):
        raise ValueError(f"{len(ps)} probabilities but {len(values)} values")
    if not ps or any(not math.isfinite(p) or p < 0 for p in ps):
        raise ValueError(f"probabilities must be finite and >= 0, got {ps}")
    total = sum(ps)
    if total <= 0:
        raise ValueError("all probabilities are zero")
    return sum(v * p for v, p in zip(values, ps)) / total


def _renormalise(logprobs: Sequence[float]) -> tuple[tuple[float, ...], float]:
    """Log-probabilities of the choices (over the full vocabulary) -> (renormalised probs, mass)."""
    m = max(logprobs)
    if not math.isfinite(m):
        raise ScoreError("every choice has zero probability under the model")
    ex = [math.exp(lp - m) for lp in logprobs]
    z = sum(ex)
    return tuple(e / z for e in ex), math.exp(m) * z


def request_hash(model_id: str, prompt: str, sampling: Sampling | str) -> str:
    """Cache key: sha256 over the model id, the exact prompt and the sampling parameters."""
    skey = sampling if isinstance(sampling, str) else sampling.key()
    h = hashlib.sha256()
    for part in (model_id, prompt, skey):
        b = part.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _short(e: BaseException, limit: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


class Backend:
    name = "base"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        self.model_dir = model_dir
        self.cfg = cfg

    def generate(self, prompts: Sequence[str], sampling: Sampling) -> list[Result]:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine (processes, memory). Safe to call twice."""

    def prompt_token_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]  # type: ignore[attr-defined]

    def choice_token_ids(self, prompt: str, choices: Sequence[str]) -> list[int]:
        """The token each choice starts with when it follows ``prompt``.

        Scoring reads one next-token distribution, so every choice must begin with its own
        token right after the prompt's tokens (a base-model prompt ending in "Score:" fails:
        " 1".." 5" all start with the space token; end it in "Score: " and score "1".."5").
        """
        enc = self.tokenizer([prompt] + [prompt + c for c in choices])["input_ids"]  # type: ignore[attr-defined]
        base, ids = enc[0], []
        for c, full in zip(choices, enc[1:]):
            if len(full) <= len(base) or full[: len(base)] != base:
                raise ScoreError(
                    f"choice {c!r} does not start a new token after the prompt (its text merges with the prompt's "
                    f"last token {prompt[-12:]!r}); end the prompt where every choice begins a token"
                )
            ids.append(full[len(base)])
        if len(set(ids)) != len(ids):
            first = {}
            for c, t in zip(choices, ids):
                first.setdefault(t, []).append(c)
            dup = next(v for v in first.values() if len(v) > 1)
            raise ScoreError(
                f"choices {dup} share their first token after the prompt, so one next-token distribution cannot "
                f"tell them apart (e.g. a prompt ending in ':' with choices ' 1'..' 5'); end the prompt with the "
                f"separator and use choices that differ in their first token"
            )
        return ids

    def _score_ids(self, prompts: Sequence[str], todo: list[int], sampling: Sampling, results: list) -> dict[int, list[int]]:
        """Choice token ids per row of ``todo``; rows that cannot be scored get a permanent error."""
        out: dict[int, list[int]] = {}
        for i in todo:
            try:
                out[i] = self.choice_token_ids(prompts[i], sampling.score_choices)  # type: ignore[arg-type]
            except ScoreError as e:
                results[i] = Result(None, error=f"cannot score choices: {e}", permanent=True)
        return out

    @staticmethod
    def _score_result(choices: Sequence[str], logprobs: Sequence[float]) -> Result:
        probs, mass = _renormalise(logprobs)
        best = max(range(len(probs)), key=probs.__getitem__)
        return Result(score_text(choices, probs, mass), output_tokens=0, finish_reason=f"score:{choices[best]}", probs=probs, choice_mass=mass)

    def _length_errors(self, prompts: Sequence[str], sampling: Sampling) -> dict[int, str]:
        limit = self.cfg.max_model_len
        out: dict[int, str] = {}
        for i, p in enumerate(prompts):
            n = len(self.prompt_token_ids(p))
            if n + sampling.max_tokens > limit:
                out[i] = (
                    f"prompt too long: {n} prompt tokens + {sampling.max_tokens} new tokens exceed "
                    f"engine.max_model_len={limit}"
                )
        return out


def apply_cpu_env(cfg: EngineConfig) -> None:
    """Process environment the vLLM CPU backend reads at start-up."""
    # One engine step must finish within this or vLLM declares the engine dead; on a CPU host
    # shared with other jobs a 4k-token prefill step can take minutes (vLLM's default: 300 s).
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(int(cfg.step_timeout_s)))
    if cfg.device == "cpu":
        # The KV cache size goes to the engine as exact bytes (kv_cache_gib may be fractional);
        # vLLM's legacy whole-GiB variable would override it.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # One CPU worker needs no engine-core and worker processes of its own: in-process the
        # engine starts in about half the time (no second and third import of torch + vLLM),
        # steps without IPC, and leaves no child process behind when its actor dies.
        if cfg.tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cfg.cpu_threads:
            # Same rule as the Ray actor's environment (runner.actor_resources): vLLM binds
            # host cores minus the reserved ones.
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(max(0, (os.cpu_count() or 1) - cfg.cpu_threads))


def engine_dtype(cfg: EngineConfig) -> str:
    """The dtype the engine computes in (see ``EngineConfig.dtype``)."""
    if cfg.dtype is not None:
        return cfg.dtype
    from atlas.hardware import native_bf16

    return "bfloat16" if cfg.device == "gpu" or native_bf16("cpu") else "float32"


def kv_cache_bytes(cfg: EngineConfig) -> int:
    """CPU engine's KV cache, ``kv_cache_gib`` in bytes."""
    return int(cfg.kv_cache_gib * 2**30)


def kv_block_size(cfg: EngineConfig) -> int | None:
    """KV-cache block size for vLLM: the prefix cache hits whole blocks only, so a small block
    keeps the tail of a shared few-shot preamble cached (CPU default 128 would recompute up to
    127 preamble tokens per prompt; the CPU attention kernel wants multiples of 32)."""
    if cfg.kv_block_size is not None:
        return cfg.kv_block_size
    return 32 if cfg.device == "cpu" else None


# Prometheus names read by VLLMBackend.metrics() (vLLM v1 metric names).
_COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_cached",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
)
_HISTOGRAMS = (
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_queue_time_seconds",
)


def metrics_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """Engine statistics between two :meth:`VLLMBackend.metrics` snapshots.

    ``prefix_cache_hit_rate``: cached / queried prompt tokens (vLLM's own definition);
    ``prefill_s`` / ``decode_s``: per-request prefill and decode times summed over requests
    (requests overlap in a batch, so these are shares of request time, not wall time);
    ``prefill_share``: prefill_s / (prefill_s + decode_s).
    """
    d = {k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in set(after) | set(before)}
    q, h = d.get("vllm:prefix_cache_queries", 0.0), d.get("vllm:prefix_cache_hits", 0.0)
    pre, dec = d.get("vllm:request_prefill_time_seconds:sum", 0.0), d.get("vllm:request_decode_time_seconds:sum", 0.0)
    return {
        "requests": d.get("vllm:request_inference_time_seconds:count", 0.0),
        "prompt_tokens": d.get("vllm:prompt_tokens", 0.0),
        "prompt_tokens_cached": d.get("vllm:prompt_tokens_cached", 0.0),
        "generation_tokens": d.get("vllm:generation_tokens", 0.0),
        "prefix_cache_queries": q,
        "prefix_cache_hits": h,
        "prefix_cache_hit_rate": (h / q) if q else None,
        "prefill_s": pre,
        "decode_s": dec,
        "prefill_share": (pre / (pre + dec)) if (pre + dec) > 0 else None,
        "preemptions": d.get("vllm:num_preemptions", 0.0),
    }


# The watchdog of :class:`ChildReaper`: a separate process that learns the engine's child
# processes on its stdin and kills those still alive once stdin closes, i.e. once the owner
# closed the engine or died in any way (a SIGKILLed Ray actor runs no Python cleanup; the
# kernel closes its end of the pipe all the same).
_WATCHDOG = r"""
import sys
import psutil
procs = {}
for line in sys.stdin:
    pid, created = line.split()
    procs[int(pid)] = float(created)
for pid, created in procs.items():
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - created) < 0.01:  # the same process, not a reused pid
            p.kill()
    except psutil.Error:
        pass
"""


class ChildReaper:
    """Makes the child processes an engine starts (vLLM's ``VLLM::EngineCore`` and its
    ``VLLM::Worker`` grandchildren) die with their owner.

    vLLM stops them when ``shutdown()`` runs, but a Ray actor killed mid-step (RPC timeout,
    ``ray.kill``, OOM) runs no shutdown, and a worker busy in a compute loop then outlives
    the engine core as an orphan (parent pid 1) spinning on the CPU. A thread records every
    descendant of this process while the engine lives and tells the watchdog process (its own
    session, so signals to the owner's process group spare it); :meth:`close` kills what is
    left now, the watchdog does it when the owner dies without closing.
    """

    def __init__(self, poll_s: float = 1.0):
        import subprocess
        import sys
        import threading

        import psutil

        self._me = psutil.Process()
        self._seen: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, text=True
        )
        # Only processes started from now on are the engine's: an owner's older children (a
        # local Ray cluster, a test's S3 server) must survive the engine. "Now" is the
        # watchdog's start on psutil's own clock: ``create_time`` counts from a boot time in
        # whole seconds, up to 1 s behind ``time.time()``, which dropped the engine's children.
        self._since = psutil.Process(self._watchdog.pid).create_time()
        self._thread = threading.Thread(target=self._poll, args=(poll_s,), name="atlas-child-reaper", daemon=True)
        self._thread.start()

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self.scan()

    def scan(self) -> list[int]:
        """Record the current descendants (returns their pids)."""
        import psutil

        pids = []
        try:
            kids = self._me.children(recursive=True)
        except psutil.Error:
            return pids
        with self._lock:
            for p in kids:
                if p.pid == self._watchdog.pid:
                    continue
                try:
                    created = p.create_time()
                except psutil.Error:
                    continue
                if created < self._since:
                    continue
                pids.append(p.pid)
                if self._seen.get(p.pid) != created:
                    self._seen[p.pid] = created
                    try:
                        self._watchdog.stdin.write(f"{p.pid} {created}\n")
                        self._watchdog.stdin.flush()
                    except (OSError, ValueError):
                        pass
        return pids

    def close(self, grace_s: float = 5.0) -> list[int]:
        """Stop watching; terminate (then kill) recorded descendants still alive. Returns the
        pids that had to be signalled. Safe to call twice."""
        import psutil

        if self._stop.is_set():
            return []
        self._stop.set()
        self.scan()
        alive = []
        with self._lock:
            for pid, created in self._seen.items():
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - created) < 0.01:
                        alive.append(p)
                except psutil.Error:
                    pass
        for p in alive:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(alive, timeout=grace_s)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=grace_s)
        try:
            self._watchdog.stdin.close()  # the watchdog finds nothing left to kill and exits
            self._watchdog.wait(timeout=grace_s)
        except Exception:  # noqa: BLE001 - best effort
            pass
        return [p.pid for p in alive]


_OPEN_BACKENDS: "weakref.WeakSet[Backend]" = weakref.WeakSet()


def _close_open_backends() -> None:
    for b in list(_OPEN_BACKENDS):
        try:
            b.close()
        except Exception:  # noqa: BLE001 - interpreter exit, best effort
            pass


atexit.register(_close_open_backends)  # a Ray actor that exits normally closes its engine


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


@contextlib.contextmanager
def _offline_llm_start(model_dir: str) -> Iterator[None]:
    """Skip two steps of vLLM's ``LLM()`` start that an offline text engine never uses.

    Measured on Gemma 3 270M (262k-token tokenizer), they take ~8 s of a ~18 s warm start:

    - ``HfRenderer`` deep-copies the tokenizer twice (2.4 s each) into a pool that makes it
      thread-safe for the *async* renderer; the offline ``LLM`` tokenizes and detokenizes on
      the calling thread (vLLM itself warns that its renderer pool is unused offline).
    - The chat-template warm-up loads the model's ``AutoProcessor`` (the tokenizer once more,
      2.9 s) to look for a processor chat template. A directory without processor configs
      has none, so the answer vLLM would cache is None: record it up front.

    Both are vLLM internals: where a later vLLM renames them this does nothing, and the start
    is merely slower. Only the ``LLM()`` call inside this block is affected.
    """
    import vllm.renderers.hf as renderer_hf

    templates = getattr(renderer_hf, "_PROCESSOR_CHAT_TEMPLATES", None)
    if isinstance(templates, dict) and not any(os.path.exists(os.path.join(model_dir, f)) for f in _PROCESSOR_FILES):
        # Key as in vllm.renderers.hf._try_get_processor_chat_template: (tokenizer path,
        # revision, code revision, trust_remote_code); Atlas sets none of the last three.
        templates.setdefault((model_dir, None, None, False), None)
    pool = getattr(renderer_hf, "maybe_make_thread_pool", None)
    if pool is not None:
        renderer_hf.maybe_make_thread_pool = lambda tokenizer, copies=1: tokenizer
    try:
        yield
    finally:
        if pool is not None:
            renderer_hf.maybe_make_thread_pool = pool


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        super().__init__(model_dir, cfg)
        apply_cpu_env(cfg)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=model_dir,
            dtype=engine_dtype(cfg),
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_prefix_caching=cfg.prefix_caching,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_model_len),
            enable_chunked_prefill=cfg.chunked_prefill,
            # Statistics on: metrics() reads the prefix-cache hit rate and prefill/decode times.
            disable_log_stats=False,
        )
        if kv_block_size(cfg) is not None:
            kwargs["block_size"] = kv_block_size(cfg)
        if cfg.device == "gpu":
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(cfg)
        t0 = time.perf_counter()
        # Started before the engine, so children of an engine that hangs while loading die too;
        # only for an engine in processes of its own (the in-process CPU engine has none).
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self._reaper = None if in_process else ChildReaper()
        _OPEN_BACKENDS.add(self)
        try:
            with _offline_llm_start(model_dir):
                self.llm = LLM(**kwargs)
        except BaseException:
            if self._reaper is not None:
                self._reaper.close()
            raise
        self.load_seconds = time.perf_counter() - t0
        self.tokenizer = self.llm.get_tokenizer()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort
                pass
            self.llm = None
        reaper = getattr(self, "_reaper", None)
        if reaper is not None:
            reaper.close()  # whatever shutdown() left behind (a worker stuck in a step)
        _OPEN_BACKENDS.discard(self)

    def _raise_if_dead(self, e: BaseException) -> None:
        """A dead engine core fails every later request: close this backend (its processes
        die, see :class:`ChildReaper`) and raise, so the owner starts a fresh one instead of
        answering each remaining row with the same error."""
        if type(e).__name__ == "EngineDeadError" or self.llm is None:
            self.close()
            raise EngineDead(f"vLLM engine died: {_short(e)}") from e

    def metrics(self) -> dict[str, float]:
        """Snapshot of vLLM's counters and histogram sums (see :func:`metrics_delta`)."""
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if m.name in _COUNTERS and hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0.0) + float(m.value)
            elif m.name in _HISTOGRAMS and hasattr(m, "sum"):
                out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + float(m.sum)
                out[m.name + ":count"] = out.get(m.name + ":count", 0.0) + float(m.count)
        return out

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def _params(self, sampling: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        so = None
        if sampling.json_schema is not None:
            so = StructuredOutputsParams(json=sampling.json_schema, disable_any_whitespace=not sampling.json_whitespace)
        elif sampling.choice is not None:
            so = StructuredOutputsParams(choice=list(sampling.choice))
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            seed=sampling.seed if sampling.temperature > 0 else None,
            frequency_penalty=sampling.frequency_penalty,
            structured_outputs=so,
        )

    def generate(self, prompts: Sequence[str], sampling: Sampling) -> list[Result]:
        results: list[Result | None] = [None] * len(prompts)
        for i, msg in self._length_errors(prompts, sampling).items():
            results[i] = Result(None, error=msg, permanent=True)
        todo = [i for i, r in enumerate(results) if r is None]
        if not todo:
            return results  # type: ignore[return-value]
        if sampling.score_choices is not None:
            return self._score(prompts, todo, sampling, results)
        params = self._params(sampling)
        try:
            outs = self.llm.generate([prompts[i] for i in todo], params, use_tqdm=False)
            for i, o in zip(todo, outs):
                results[i] = self._result(o)
        except Exception as e:  # noqa: BLE001 - isolate the failing row(s), keep the rest
            self._raise_if_dead(e)
            for i in todo:
                try:
                    results[i] = self._result(self.llm.generate([prompts[i]], params, use_tqdm=False)[0])
                except Exception as e:  # noqa: BLE001
                    self._raise_if_dead(e)
                    results[i] = Result(None, error=f"engine rejected the request: {_short(e)}")
        return results  # type: ignore[return-value]

    @staticmethod
    def _result(o) -> Result:
        c = o.outputs[0]
        return Result(c.text, output_tokens=len(c.token_ids), finish_reason=str(c.finish_reason))

    def _score(self, prompts: Sequence[str], todo: list[int], sampling: Sampling, results: list) -> list[Result]:
        from vllm import SamplingParams

        choices = sampling.score_choices
        ids = self._score_ids(prompts, todo, sampling, results)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, t in ids.items():
            groups.setdefault(tuple(t), []).append(i)
        for tids, idx in groups.items():
            # One generated token; its logprob entries are the raw (full-vocabulary) log-softmax
            # of exactly these ids, so renormalising over them is the choice distribution.
            params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(tids), detokenize=False)

            def one(o) -> Result:
                lp = o.outputs[0].logprobs[0]
                return self._score_result(choices, [lp[t].logprob for t in tids])  # type: ignore[arg-type]

            try:
                for i, o in zip(idx, self.llm.generate([prompts[i] for i in idx], params, use_tqdm=False)):
                    results[i] = one(o)
            except Exception as e:  # noqa: BLE001 - isolate the failing row(s), keep the rest
                self._raise_if_dead(e)
                for i in idx:
                    try:
                        results[i] = one(self.llm.generate([prompts[i]], params, use_tqdm=False)[0])
                    except Exception as e:  # noqa: BLE001
                        self._raise_if_dead(e)
                        results[i] = Result(None, error=f"engine rejected the scoring request: {_short(e)}")
        return results  # type: ignore[return-value]


class TransformersBackend(Backend):
    """Plain ``transformers`` generate (the baseline, and a fallback where vLLM is missing).

    Output constraints are enforced with xgrammar's logits processor when it is installed, so
    both backends answer in the same shape.
    """

    name = "transformers"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        super().__init__(model_dir, cfg)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        self.torch = torch
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(engine_dtype(cfg), "auto")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        device = "cuda" if cfg.device == "gpu" and torch.cuda.is_available() else "cpu"
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        torch.manual_seed(cfg.seed)
        self._grammar = None
        self.load_seconds = time.perf_counter() - t0

    def _compiler(self):
        if self._grammar is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.model.config.vocab_size)
            self._grammar = xgr.GrammarCompiler(info)
        return self._grammar

    def _logits_processor(self, sampling: Sampling, n: int):
        if sampling.json_schema is None and sampling.choice is None:
            return None
        try:
            import xgrammar as xgr
        except ImportError:
            return None
        comp = self._compiler()
        if sampling.json_schema is not None:
            g = comp.compile_json_schema(json.dumps(sampling.json_schema), any_whitespace=sampling.json_whitespace)
        else:
            alts = " | ".join(json.dumps(c) for c in sampling.choice)  # type: ignore[union-attr]
            g = comp.compile_grammar(f"root ::= {alts}")
        return xgr.contrib.hf.LogitsProcessor([g] * n)

    def generate(self, prompts: Sequence[str], sampling: Sampling) -> list[Result]:
        results: list[Result | None] = [None] * len(prompts)
        for i, msg in self._length_errors(prompts, sampling).items():
            results[i] = Result(None, error=msg, permanent=True)
        todo = [i for i, r in enumerate(results) if r is None]
        if sampling.score_choices is not None:
            return self._score(prompts, todo, sampling, results)
        bs = max(1, self.cfg.batch_size)
        for s in range(0, len(todo), bs):
            idx = todo[s : s + bs]
            try:
                for i, r in zip(idx, self._generate_batch([prompts[i] for i in idx], sampling)):
                    results[i] = r
            except Exception:  # noqa: BLE001
                for i in idx:
                    try:
                        results[i] = self._generate_batch([prompts[i]], sampling)[0]
                    except Exception as e:  # noqa: BLE001
                        results[i] = Result(None, error=f"generation failed: {_short(e)}")
        return results  # type: ignore[return-value]

    def _score(self, prompts: Sequence[str], todo: list[int], sampling: Sampling, results: list) -> list[Result]:
        choices = sampling.score_choices
        ids = self._score_ids(prompts, todo, sampling, results)
        rows = [i for i in todo if i in ids]
        bs = max(1, self.cfg.batch_size)
        for s in range(0, len(rows), bs):
            idx = rows[s : s + bs]
            try:
                lps = self._last_logprobs([prompts[i] for i in idx], [ids[i] for i in idx])
                for i, lp in zip(idx, lps):
                    results[i] = self._score_result(choices, lp)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001
                for i in idx:
                    try:
                        results[i] = self._score_result(choices, self._last_logprobs([prompts[i]], [ids[i]])[0])  # type: ignore[arg-type]
                    except Exception as e:  # noqa: BLE001
                        results[i] = Result(None, error=f"scoring failed: {_short(e)}")
        return results  # type: ignore[return-value]

    def _last_logprobs(self, prompts: list[str], ids: list[list[int]]) -> list[list[float]]:
        """Full-vocabulary log-softmax at the last prompt position, gathered at ``ids``."""
        torch = self.torch
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=True).to(self.device)
        # Left padding: positions count real tokens only, as in generate().
        pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            logits = self.model(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], position_ids=pos, logits_to_keep=1
            ).logits[:, -1, :]
            logp = torch.log_softmax(logits.float(), dim=-1)
            idx = torch.tensor(ids, dtype=torch.long, device=logp.device)
            return torch.gather(logp, 1, idx).tolist()

    def _generate_batch(self, prompts: list[str], sampling: Sampling) -> list[Result]:
        torch = self.torch
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=True).to(self.device)
        lp = self._logits_processor(sampling, len(prompts))
        kw: dict[str, Any] = dict(max_new_tokens=sampling.max_tokens, pad_token_id=self.tokenizer.pad_token_id)
        if sampling.temperature > 0:
            kw.update(do_sample=True, temperature=sampling.temperature)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if sampling.frequency_penalty:
            kw["repetition_penalty"] = 1.0 + sampling.frequency_penalty / 4
        if lp is not None:
            kw["logits_processor"] = [lp]
        with torch.inference_mode():
            out = self.model.generate(**enc, **kw)
        new = out[:, enc["input_ids"].shape[1] :]
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        res = []
        for row in new.tolist():
            n = len(row)
            finish = "length"
            for j, t in enumerate(row):
                if t == eos or (t == pad and pad != eos and j > 0):
                    n, finish = j, "stop"
                    break
            res.append(Result(self.tokenizer.decode(row[:n], skip_special_tokens=True), output_tokens=n, finish_reason=finish))
        return res


def make_backend(model_dir: str, cfg: EngineConfig) -> Backend:
    if cfg.backend == "vllm":
        return VLLMBackend(model_dir, cfg)
    if cfg.backend == "transformers":
        return TransformersBackend(model_dir, cfg)
    raise ValueError(f"unknown engine backend {cfg.backend!r}")

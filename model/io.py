"""Save / load Steerling checkpoints: model.safetensors + config.json + tokenizer.json
(+ concepts.json with the known-concept names). Loading never unpickles."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.modeling import Steerling
from model.tokenizer import load_tokenizer, save_tokenizer

WEIGHTS, CONFIG, TOKENIZER, CONCEPTS = "model.safetensors", "config.json", "tokenizer.json", "concepts.json"


def save_pretrained(model: Steerling, out_dir: str | Path, tokenizer=None, concept_names=None,
                    metadata: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}})
    model.cfg.to_json(out / CONFIG)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out / TOKENIZER)
    if concept_names is not None:
        (out / CONCEPTS).write_text(json.dumps(list(concept_names), indent=0))
    return out


def load_pretrained(path: str | Path, device: str | torch.device = "cpu"):
    """Returns (model, tokenizer or None, concept_names or None)."""
    path = Path(path)
    cfg = ModelConfig.from_json(path / CONFIG)
    model = Steerling(cfg)
    state = load_file(str(path / WEIGHTS), device=str(device))
    model.load_state_dict(state, strict=True)
    model.to(device)
    tok = load_tokenizer(path / TOKENIZER) if (path / TOKENIZER).exists() else None
    names = json.loads((path / CONCEPTS).read_text()) if (path / CONCEPTS).exists() else None
    return model, tok, names

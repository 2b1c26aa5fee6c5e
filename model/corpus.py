"""Single-process text -> packed, chunk-labelled sequences (no Ray; model/data.py is the
later shard reader). Used by model.loop.train, the tests and the benchmarks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.config import EOS_ID
from model.labels import StandInLabeller

_TITLE = re.compile(r"^ ?= [^=].* = ?$")
_HEADING = re.compile(r"^ ?(=(?: =)+) (.+?) (?:= )*= ?$")


def read_documents(corpus) -> list[str]:
    """A .txt file, a directory of .txt files (sorted), or a list of documents.

    Wikitext-style files (" = Title = " lines) are split into one document per article.
    """
    if isinstance(corpus, (list, tuple)):
        return [d for d in corpus if d.strip()]
    path = Path(corpus)
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .txt files in {path}")
    docs: list[str] = []
    for f in files:
        docs.extend(split_articles(f.read_text(encoding="utf-8")))
    return docs


def split_articles(text: str) -> list[str]:
    docs, cur = [], []
    for line in text.splitlines():
        if _TITLE.match(line) and cur:
            docs.append("\n".join(cur))
            cur = []
        cur.append(line)
    if cur:
        docs.append("\n".join(cur))
    return [d for d in docs if d.strip()]


def split_sections(doc: str) -> list[tuple[str, str]]:
    """(heading, text) pieces of a document; the heading is "" before the first one."""
    out, head, cur = [], "", []
    for line in doc.splitlines():
        m = _HEADING.match(line)
        if m:
            if cur:
                out.append((head, "\n".join(cur)))
            head, cur = m.group(2).strip(), [line]
        else:
            cur.append(line)
    if cur:
        out.append((head, "\n".join(cur)))
    return out


@dataclass
class PackedData:
    """Packed sequences (S, T) and per-chunk multi-hot labels (S, T // chunk_len, n)."""

    ids: torch.Tensor
    labels: torch.Tensor | None
    chunk_len: int

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, index: torch.Tensor) -> dict:
        ids = self.ids[index]
        out = {"input_ids": ids}
        if self.labels is not None:
            B, T = ids.shape
            nc = self.labels.shape[1]
            cid = torch.arange(B * nc).view(B, nc).repeat_interleave(self.chunk_len, dim=1)
            if cid.shape[1] < T:  # tail shorter than a chunk: unlabelled
                cid = torch.cat([cid, cid.new_full((B, T - cid.shape[1]), -1)], dim=1)
            out["chunk_ids"] = cid
            out["chunk_labels"] = self.labels[index].reshape(B * nc, -1).float()
        return out


def pack(docs: list[str], tokenizer, seq_len: int, chunk_len: int,
         labeller: StandInLabeller | None = None, n_labels: int | None = None) -> PackedData:
    """Tokenise documents section by section, join with [EOS], cut into seq_len windows,
    and label every chunk_len-token chunk with the labeller (decoded chunk text + the
    section most of its tokens come from). ``n_labels`` pads the label width (n_known
    may exceed the labeller's library; the extra concepts are simply never positive)."""
    pieces, piece_sec, sec_names = [], [], {"": 0}
    for doc in docs:
        secs = split_sections(doc)
        for j, (head, text) in enumerate(secs):
            pieces.append(text + ("\n" if j < len(secs) - 1 else ""))
            piece_sec.append(sec_names.setdefault(head, len(sec_names)))
        pieces.append(None)  # document boundary
        piece_sec.append(0)
    texts = [p for p in pieces if p is not None]
    enc = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
    ids, secs = [], []
    for p, s in zip(pieces, piece_sec):
        toks = [EOS_ID] if p is None else next(enc).ids
        ids.extend(toks)
        secs.extend([s] * len(toks))
    n_seq = len(ids) // seq_len
    if n_seq == 0:
        raise ValueError(f"corpus has {len(ids)} tokens, fewer than seq_len={seq_len}")
    arr = torch.tensor(ids[: n_seq * seq_len], dtype=torch.long).view(n_seq, seq_len)
    labels = None
    if labeller is not None:
        nc = seq_len // chunk_len
        sec_arr = np.asarray(secs[: n_seq * seq_len]).reshape(n_seq, seq_len)
        inv_sec = {v: k for k, v in sec_names.items()}
        chunks = arr[:, : nc * chunk_len].reshape(n_seq * nc, chunk_len)
        chunk_text = tokenizer.decode_batch(chunks.tolist())
        chunk_sec = sec_arr[:, : nc * chunk_len].reshape(n_seq * nc, chunk_len)
        labels = torch.zeros(n_seq * nc, max(n_labels or 0, labeller.n_concepts), dtype=torch.bool)
        for c, (text, sec) in enumerate(zip(chunk_text, chunk_sec)):
            major = inv_sec[int(np.bincount(sec).argmax())]
            lab = labeller.label(text, major)
            if lab:
                labels[c, lab] = True
        labels = labels.view(n_seq, nc, -1)
    return PackedData(arr, labels, chunk_len)


def sections_of(docs: list[str]) -> list[tuple[str, str]]:
    return [s for d in docs for s in split_sections(d)]

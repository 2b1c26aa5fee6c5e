"""Token-aware chunking: ``documents`` -> ``chunks``.

Chunks are measured in the tagging model's tokens. Text is split at paragraph boundaries
first, then sentences, and only a sentence longer than ``max_tokens`` is cut on token
boundaries. Every chunk is an exact slice ``text[char_start:char_end]`` of its document, so
offsets stay meaningful downstream, and ids are ``<doc_id>-<index>``: stable across reruns.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from atlas import schemas, storage
from atlas.config import ChunkingConfig

_PARAGRAPH = re.compile(r"\n\s*\n")
# A sentence ends at . ! ? (optionally followed by a closing quote/bracket, which stays with
# the sentence) and whitespace.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+")


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """The model's Rust tokenizer (``tokenizers.Tokenizer``), with no truncation or padding.
    From its ``tokenizer.json`` when there is one: ~0.02 s for MiniLM where transformers'
    AutoTokenizer takes ~4.8 s (mostly importing transformers), paid in every fresh Ray
    worker that chunks; ids and offsets are the same (checked on the demo corpus for MiniLM
    and Gemma 3). Otherwise the backend of transformers' fast tokenizer."""
    from pathlib import Path

    file = Path(path) / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(file))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path).backend_tokenizer
    tok.no_truncation()  # a tokenizer.json may carry the encoder's max length (MiniLM: 128)
    tok.no_padding()
    return tok


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    tokens: int


def _spans(text: str, pattern: re.Pattern, start: int, end: int) -> list[tuple[int, int]]:
    """Split text[start:end] at ``pattern`` into non-blank (start, end) pieces."""
    out, pos = [], start
    for m in pattern.finditer(text, start, end):
        if text[pos : m.start()].strip():
            out.append((pos, m.start()))
        pos = m.end()
    if text[pos:end].strip():
        out.append((pos, end))
    return out


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


class Chunker:
    def __init__(self, tokenizer: Any, cfg: ChunkingConfig):
        self.tok = tokenizer
        self.cfg = cfg

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def _cut_long(self, text: str, start: int, end: int) -> list[Span]:
        """Cut one over-long sentence into pieces of <= target_tokens at token boundaries."""
        offsets = self.tok.encode(text[start:end], add_special_tokens=False).offsets
        pieces, step = [], self.cfg.target_tokens
        for i in range(0, len(offsets), step):
            group = offsets[i : i + step]
            a = start + group[0][0]
            b = start + (offsets[i + step][0] if i + step < len(offsets) else end - start)
            a, b = _trim(text, a, b)
            if b > a:
                pieces.append(Span(a, b, self.count(text[a:b])))
        return pieces

    def units(self, text: str) -> list[tuple[Span, bool]]:
        """Sentences (or cut pieces) with a flag marking the first unit of each paragraph."""
        out: list[tuple[Span, bool]] = []
        for p_start, p_end in _spans(text, _PARAGRAPH, 0, len(text)):
            first = True
            for s_start, s_end in _spans(text, _SENTENCE_END, p_start, p_end):
                s_start, s_end = _trim(text, s_start, s_end)
                n = self.count(text[s_start:s_end])
                pieces = self._cut_long(text, s_start, s_end) if n > self.cfg.max_tokens else [Span(s_start, s_end, n)]
                for piece in pieces:
                    out.append((piece, first))
                    first = False
        return out

    def chunk(self, text: str) -> list[Span]:
        cfg = self.cfg
        chunks: list[Span] = []
        cur: list[Span] = []
        cur_tokens = 0

        def close() -> None:
            nonlocal cur, cur_tokens
            if cur:
                a, b = cur[0].start, cur[-1].end
                chunks.append(Span(a, b, self.count(text[a:b])))
            cur, cur_tokens = [], 0

        for unit, starts_paragraph in self.units(text):
            # Prefer a paragraph boundary once the chunk is at least half full.
            if cur and starts_paragraph and cur_tokens >= cfg.target_tokens // 2:
                close()
            if cur and cur_tokens + unit.tokens > cfg.target_tokens:
                close()
            cur.append(unit)
            cur_tokens += unit.tokens
        close()
        # A short tail joins the previous chunk when the result still fits.
        if len(chunks) >= 2 and chunks[-1].tokens < cfg.min_tokens:
            a, b = chunks[-2].start, chunks[-1].end
            merged = self.count(text[a:b])
            if merged <= cfg.max_tokens:
                chunks[-2:] = [Span(a, b, merged)]
        return chunks


def chunk_documents(batch: pa.Table, tokenizer_path: str, cfg: ChunkingConfig) -> pa.Table:
    chunker = Chunker(load_tokenizer(tokenizer_path), cfg)
    rows = []
    for doc_id, text in zip(batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()):
        for i, span in enumerate(chunker.chunk(text)):
            rows.append(
                {
                    "chunk_id": f"{doc_id}-{i:05d}",
                    "doc_id": doc_id,
                    "chunk_index": i,
                    "text": text[span.start : span.end],
                    "n_tokens": span.tokens,
                    "char_start": span.start,
                    "char_end": span.end,
                }
            )
    return pa.Table.from_pylist(rows, schema=schemas.CHUNKS)


def chunk(root: storage.Location, tokenizer_path: str, cfg: ChunkingConfig) -> dict[str, Any]:
    """Chunk the published ``documents`` table with Ray Data and publish ``chunks``."""
    docs = storage.read_dataset(root, "documents")
    chunks = docs.map_batches(
        chunk_documents,
        fn_kwargs={"tokenizer_path": tokenizer_path, "cfg": cfg},
        batch_format="pyarrow",
        batch_size=16,
        num_cpus=0.5,
    ).materialize()
    chunks = storage.sort_dataset(chunks, "chunk_id", chunks.size_bytes())
    ptr = storage.write_dataset(root, "chunks", chunks, schemas.CHUNKS)
    table = storage.read_table(root, "chunks", columns=["n_tokens"])
    n = table.column("n_tokens").to_numpy()
    stats = {"chunks": ptr["rows"]}
    if len(n):
        stats.update(mean_tokens=round(float(n.mean()), 1), max_tokens=int(n.max()), min_tokens=int(n.min()))
    return stats


# ---------------------------------------------------------------- stage


from atlas.stage import BaseStage, register  # noqa: E402 - the stage wrapper needs the functions above


@register
class ChunkStage(BaseStage):
    """``documents`` -> ``chunks`` (tokenizer: ``chunking.tokenizer`` or the tagging model's)."""

    name = "chunk"
    inputs = ("documents",)
    outputs = ("chunks",)
    config_keys = ("chunking", "engine.model")

    def run(self, ctx) -> dict:
        from atlas.engine import resolve_model

        tokenizer = ctx.cfg.chunking.tokenizer or resolve_model(ctx.cfg.engine.model)
        return {**chunk(ctx.root, tokenizer, ctx.cfg.chunking), "tokenizer": tokenizer}

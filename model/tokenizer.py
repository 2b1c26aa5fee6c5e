"""Byte-level BPE tokenizer (Hugging Face `tokenizers`) with Steerling's special tokens.

The special tokens take ids 0..4 in a fixed order (model.config.SPECIAL_TOKENS), so a
ModelConfig can name [MASK] / [PAD] without holding a tokenizer. [MASK] is a real
vocabulary entry: the diffusion objective feeds it, so an all-[MASK] input is in
distribution (the trained absence baseline used by input attribution).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.config import SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (specials included)."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    check_special_ids(tok)
    return tok


def check_special_ids(tok: Tokenizer) -> None:
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise ValueError(f"tokenizer maps {name} to {tok.token_to_id(name)}, expected {i}")


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    tok.save(str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    check_special_ids(tok)
    return tok

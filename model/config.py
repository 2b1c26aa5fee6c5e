"""Validated configs for Steerling models and single-process training.

Both configs are pydantic v2 models with ``extra="forbid"``: an unknown key raises a
``ValidationError`` whose message names the key, so a typo in a sweep file fails loudly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["ar", "ar_concept", "cdlm", "cdlm_concept"]

# Special tokens: fixed ids at the front of every tokenizer we train, so configs can name
# them without a tokenizer at hand.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]")
PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID = range(len(SPECIAL_TOKENS))

# Vocabulary of the released Steerling-8B (cl100k_base + 4 specials); used by paper presets.
PAPER_VOCAB = 100_281


class ModelConfig(BaseModel):
    """Shape of one Steerling model (any of the four families)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    family: Family = "cdlm_concept"
    vocab_size: int = Field(1024, ge=len(SPECIAL_TOKENS) + 1)
    n_layers: int = Field(2, ge=1)
    d_model: int = Field(64, ge=8)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int = Field(4, ge=1)
    ffn_hidden: int | None = None  # SwiGLU width; None -> 8/3 * d rounded up to 64
    max_seq_len: int = Field(128, ge=2)
    block_size: int = Field(16, ge=1)  # diffusion block (CDLM); ignored by AR
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True
    tie_embeddings: bool = True
    init_std: float = 0.02
    # "sdpa" runs everywhere; "flex" (torch flex_attention, block-sparse) is the fast GPU
    # path for the block-causal mask; "auto" picks flex on CUDA for CDLM, sdpa otherwise.
    attn_backend: Literal["sdpa", "flex", "auto"] = "auto"

    # Concept module (used only by *_concept families).
    # Defaults are the "tiny" shape so ModelConfig() is valid; non-concept families ignore them.
    n_known: int = Field(32, ge=0)
    n_unknown: int = Field(96, ge=0)
    topk_known: int = Field(4, ge=0)
    topk_unknown: int = Field(8, ge=0)
    unknown_rank: int = Field(16, ge=0)  # rank R of the unknown head (d->R->m) and of U = coef @ basis
    concept_logit_clamp: float = Field(15.0, gt=0)

    mask_token_id: int = MASK_ID
    pad_token_id: int = PAD_ID

    @property
    def has_concepts(self) -> bool:
        return self.family in ("ar_concept", "cdlm_concept")

    @property
    def is_diffusion(self) -> bool:
        return self.family in ("cdlm", "cdlm_concept")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return int(math.ceil(8 * self.d_model / 3 / 64) * 64)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.is_diffusion and self.max_seq_len % self.block_size:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) must be a multiple of block_size ({self.block_size})")
        for name in ("mask_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} must be a valid token id < vocab_size")
        if self.has_concepts:
            if self.n_known < 1 or self.n_unknown < 1:
                raise ValueError("concept families need n_known >= 1 and n_unknown >= 1")
            if not 1 <= self.topk_known <= self.n_known:
                raise ValueError(f"topk_known must be in [1, n_known={self.n_known}]")
            if not 1 <= self.topk_unknown <= self.n_unknown:
                raise ValueError(f"topk_unknown must be in [1, n_unknown={self.n_unknown}]")
            if self.unknown_rank < 1:
                raise ValueError("unknown_rank must be >= 1 for concept families")
        return self

    # -- presets / serialisation -------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named shape ("tiny", Table 24 "10M".."5B", "8B") plus overrides.

        Concept counts default to the preset's; for non-concept families they are zeroed.
        """
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        data = dict(PRESETS[name])
        data.update(overrides)
        family = data.get("family", "cdlm_concept")
        if family in ("ar", "cdlm"):
            for key in ("n_known", "n_unknown", "topk_known", "topk_unknown", "unknown_rank"):
                if key not in overrides:
                    data[key] = 0
        return cls.model_validate(data)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=2))

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))


# Paper concept-module shape at 8B (guidelabs/steerling), used at every paper size: this is
# what makes small +Concept models concept-module dominated (Table 24). Paper presets use a
# SwiGLU width of 4d (the anchor's mlp_ratio 4); backbone counts then land within ~7% of
# Table 24 at 10M-200M and ~0.5% at 5B.
_PAPER_CONCEPTS = dict(n_known=33_732, n_unknown=101_196, topk_known=32, topk_unknown=128, unknown_rank=256)


def _paper(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> dict:
    return dict(
        vocab_size=PAPER_VOCAB, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=n_kv_heads or n_heads, ffn_hidden=4 * d_model, max_seq_len=4096, block_size=64, rope_base=500_000.0,
        **_PAPER_CONCEPTS,
    )


PRESETS: dict[str, dict[str, Any]] = {
    # CPU test shape.
    "tiny": dict(vocab_size=1024, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=128,
                 block_size=16, n_known=32, n_unknown=96, topk_known=4, topk_unknown=8, unknown_rank=16),
    # CPU benchmark shape: the Table 24 25M backbone (23.6M) with 2,000 known / 6,000 unknown
    # concepts, the paper's top-k (32 / 128) and rank (256), a CPU-sized vocabulary.
    "bench25M": dict(vocab_size=8192, n_layers=6, d_model=512, n_heads=8, n_kv_heads=4, ffn_hidden=2048,
                     max_seq_len=256, block_size=64, n_known=2000, n_unknown=6000, topk_known=32,
                     topk_unknown=128, unknown_rank=256),
    # Table 24 backbones (layers, d). Heads / KV heads are our choice (the paper gives only
    # L and d), picked so that with a 4d SwiGLU the backbone counts reproduce Table 24
    # (attention 3d^2 at 10M/25M, 2.5d^2 at 85M-400M, 2.25d^2 at 800M-3B, 4d^2 at 5B).
    "10M": _paper(6, 320, 10, 5),
    "25M": _paper(6, 512, 8, 4),
    "85M": _paper(10, 768, 12, 3),
    "200M": _paper(13, 1024, 16, 4),
    "400M": _paper(17, 1280, 20, 5),
    "800M": _paper(17, 1792, 16, 2),
    "1.5B": _paper(20, 2304, 24, 3),
    "3B": _paper(24, 3072, 24, 3),
    "5B": _paper(24, 3840, 30, 30),
    # Released Steerling-8B: 32 layers, d=4096, 32 heads / 4 KV heads, block 64.
    "8B": _paper(32, 4096, 32, 4),
}


class TrainConfig(BaseModel):
    """Single-process training run (also read by the distributed trainer's step)."""

    model_config = ConfigDict(extra="forbid")

    steps: int | None = Field(None, ge=1)
    total_tokens: int | None = Field(None, ge=1)  # alternative to steps
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=2)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    eval_every: int = Field(0, ge=0)  # 0 -> evaluate only at the end
    eval_batches: int = Field(4, ge=1)
    seed: int = 0
    # auto: bf16 autocast where bf16 is native (CUDA; CPUs with AVX512-BF16/AMX), else fp32
    # (emulated bf16 matmuls run ~100x slower than fp32 on an AVX2-only CPU).
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    threads: int | None = None  # torch.set_num_threads; None leaves it alone

    # Masked diffusion objective.
    t_min: float = Field(1e-3, gt=0, lt=1)  # floor on the per-block masking rate
    antithetic_t: bool = True  # stratified t across the batch's blocks (low variance)

    # Interpretability losses: L = L_lm + w_c L_concept + w_r L_rec + w_i L_indep.
    concept_weight: float = Field(1.0, ge=0)
    rec_weight: float = Field(1.0, ge=0)
    indep_weight: float = Field(1.0, ge=0)
    concept_pos_weight: float = Field(1.0, gt=0)  # weight of the positive-pair mean in the balanced concept loss
    # Per-sequence eps-dropout (training only): the share of sequences whose residual eps is
    # dropped, so their LM loss runs through k_hat + sg(u_hat) and trains the known head and K.
    eps_dropout: float = Field(0.1, ge=0, lt=1)
    # Bound on the known concepts scored by the concept loss per batch: None scores all n
    # (one fused softplus pass over (positions, n)); an int scores the batch's positive
    # concepts + that many sampled negatives (+ the active top-k), so the known head's
    # backward is O(positions x (positives + negatives)) instead of O(positions x n).
    concept_negatives: int | None = Field(None, ge=1)
    # Share of the auxiliary losses' gradient (concept loss via the known head, coverage via
    # the reconstruction target) that reaches the backbone through h; the concept heads
    # always learn at full weight. 1.0 = the paper's plain sum. On a tiny backbone the
    # concept loss's backbone gradient is 2-22x the LM's and (AdamW normalising per
    # parameter) owns the backbone: AR LM +1.16 nats at 150 steps; 0 gives +0.04 but
    # held-out AUC 0.65 instead of ~0.85 (model/README.md, planted benchmark).
    aux_backbone_grad: float = Field(1.0, ge=0, le=1)

    # Teacher forcing: k_hat = w * k_hat(labels) + (1 - w) * k_hat(predicted), with
    # w = tf_start for the first tf_hold_frac of steps, cosine to tf_final by tf_end_frac.
    tf_start: float = Field(1.0, ge=0, le=1)
    tf_final: float = Field(0.0, ge=0, le=1)
    tf_hold_frac: float = Field(0.15, ge=0, le=1)
    tf_end_frac: float = Field(0.5, ge=0, le=1)

    # Data.
    chunk_len: int = Field(64, ge=1)  # tokens per labelled chunk (paper: ~112 on average)
    val_fraction: float = Field(0.05, gt=0, lt=1)

    checkpoint_dir: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if (self.steps is None) == (self.total_tokens is None):
            raise ValueError("set exactly one of steps or total_tokens")
        if self.tf_end_frac < self.tf_hold_frac:
            raise ValueError("tf_end_frac must be >= tf_hold_frac")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return max(1, math.ceil(self.total_tokens / self.tokens_per_step))

    def teacher_forcing(self, step: int, total_steps: int | None = None) -> float:
        """Weight of ground-truth labels in k_hat at ``step`` (0-based)."""
        total = total_steps or self.total_steps
        frac = step / max(1, total)
        if frac <= self.tf_hold_frac:
            return self.tf_start
        if frac >= self.tf_end_frac:
            return self.tf_final
        x = (frac - self.tf_hold_frac) / max(1e-12, self.tf_end_frac - self.tf_hold_frac)
        return self.tf_final + (self.tf_start - self.tf_final) * 0.5 * (1 + math.cos(math.pi * x))

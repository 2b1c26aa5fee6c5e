"""Parameter and training-FLOP counts per ModelConfig (analytic; no model is built).

Used by the scaling toolkit, so the definitions are fixed here once:

* ``embedding``      token embedding table (plus the LM head if untied).
* ``backbone``       transformer blocks + final norm (Table 24 "Backbone params").
* ``concept``        every concept-module parameter.
* ``concept_heads``  the parts applied densely to every token: known head f (d x n), the
                     rank-R unknown head g (d x R, R x m) and the rank-R basis of U. The per-concept tables K and coef are only
                     read at the top-k active rows (lookups), like an embedding.
* ``non_embedding``  backbone + concept_heads: the P of the scaling fits (Table 24
                     "+Concept total params" counts the heads, not the factorised tables).
* ``total``          every parameter of the model.
"""

from __future__ import annotations

from model.config import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    d, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    f = cfg.ffn_dim
    attn = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d
    mlp = 3 * d * f
    norms = 2 * d + (2 * hd if cfg.qk_norm else 0)
    backbone = L * (attn + mlp + norms) + d
    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    heads = tables = 0
    if cfg.has_concepts:
        n, m, R = cfg.n_known, cfg.n_unknown, cfg.unknown_rank
        heads = (d * n + n) + (d * R + R * m + m) + R * d
        tables = n * d + m * R
    return {
        "total": embedding + backbone + heads + tables,
        "non_embedding": backbone + heads,
        "embedding": embedding,
        "backbone": backbone,
        "concept": heads + tables,
        "concept_heads": heads,
        "concept_tables": tables,
    }


def attended_keys(cfg: ModelConfig, seq_len: int) -> float:
    """Mean number of keys a query attends to (what an attention kernel must compute).

    causal: (T + 1) / 2.  block-causal with block B and T = nb * B: a query in block b
    sees (b + 1) * B keys, mean B * (nb + 1) / 2 = (T + B) / 2, i.e. slightly more than
    causal (a whole extra half block per query).
    """
    if cfg.is_diffusion:
        B = cfg.block_size
        nb = seq_len // B
        return B * (nb + 1) / 2
    return (seq_len + 1) / 2


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, include_lm_head: bool = False) -> float:
    """Training FLOPs per token = 6 * N_non_embedding + attention + sparse concept lookups.

    * 6 * N: forward 2 FLOPs per weight, backward 4 (Kaplan/Chinchilla convention).
    * attention: QK^T and AV cost 2 * 2 * d_attn FLOPs per (query, key) pair forward,
      x3 for training -> 12 * L * d_attn * attended_keys(T), using the mask's real density
      (causal vs block-causal, see ``attended_keys``).
    * concept lookups: weighted sums of the top-k rows of K (k_known * d) and of coef
      (k_unknown * R), x6.
    * ``include_lm_head``: add 6 * V * d for the output projection, which the convention
      leaves out (it is embedding-like) but which a small model really spends; used when
      measuring achieved FLOP/s.
    """
    T = seq_len or cfg.max_seq_len
    p = count_params(cfg)
    flops = 6.0 * p["non_embedding"]
    flops += 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * attended_keys(cfg, T)
    if cfg.has_concepts:
        flops += 6.0 * (cfg.topk_known * cfg.d_model + cfg.topk_unknown * cfg.unknown_rank)
    if include_lm_head:
        flops += 6.0 * cfg.vocab_size * cfg.d_model
    return flops


def train_flops(cfg: ModelConfig, tokens: float, seq_len: int | None = None, include_lm_head: bool = False) -> float:
    """Total training FLOPs for ``tokens`` tokens (see ``train_flops_per_token``)."""
    return train_flops_per_token(cfg, seq_len, include_lm_head) * float(tokens)

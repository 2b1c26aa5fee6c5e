"""Steerling compute graph: decoder backbone, attention masks, concept module, decomposition.

Pure PyTorch (no Ray). One class serves all four families:
  ar / cdlm                 h -> W h
  ar_concept / cdlm_concept h -> concept module -> h_bar = k_hat + u_hat + eps -> W h_bar
The only AR/CDLM difference inside the network is the attention mask (causal vs
block-causal); the objectives (model/objectives.py) decide what the input and targets are.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


# ----------------------------------------------------------------------------- masks
def block_causal_mask(seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Boolean (T, T) mask, True = may attend: query q sees key k iff q // B >= k // B."""
    blk = torch.arange(seq_len, device=device) // block_size
    return blk[:, None] >= blk[None, :]


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Boolean (T, T) lower-triangular mask (AR)."""
    pos = torch.arange(seq_len, device=device)
    return pos[:, None] >= pos[None, :]


# ----------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, hd); cos/sin: (T, hd/2). Rotate-half convention on the two halves of
    each head; applied in (B, T, H, hd) layout, where x is contiguous (cheaper on CPU)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


_flex_compiled = None


def _flex_attention(q, k, v, block_mask):
    """flex_attention with the block-sparse mask: compiled on CUDA (the fast path, skips
    fully masked tiles); eager elsewhere (a reference path, used by the CPU tests)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        fn = _flex_compiled
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * self.hd, bias=False)
        self.out = nn.Linear(cfg.n_heads * self.hd, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.hd, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask_info) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_heads + 2 * self.n_kv, self.hd)
        q, k, v = qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=2)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        kind, mask = mask_info
        if kind == "flex":
            y = _flex_attention(q, k, v, mask)
        else:
            if self.n_kv != self.n_heads:  # expand KV heads (GQA) so every SDPA kernel applies
                rep = self.n_heads // self.n_kv
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if kind == "causal":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)  # gate and value fused
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        gate, val = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * val)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, mask_info):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask_info)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------- concepts
@dataclass
class ConceptOutput:
    """Concept-module results for N selected positions (flattened)."""

    known_logits: torch.Tensor | None  # (N, n) clamped dense known logits, when computed densely
    known_idx: torch.Tensor  # (N, k_known) active known concepts
    known_w: torch.Tensor  # (N, k_known) their sigmoid activations
    unknown_idx: torch.Tensor  # (N, k_unknown)
    unknown_w: torch.Tensor  # (N, k_unknown)
    k_hat: torch.Tensor  # (N, d) known contribution actually composed (may be teacher-forced)
    k_hat_pred: torch.Tensor  # (N, d) known contribution from the predicted activations
    u_hat: torch.Tensor  # (N, d)
    eps: torch.Tensor  # (N, d) residual h - k_hat - u_hat (zero where eps-dropout dropped it)
    h_bar: torch.Tensor  # (N, d) k_hat + u_hat + eps, numerically equal to h unless eps was dropped


def _selection_matrix(idx: torch.Tensor, values: torch.Tensor, m: int) -> torch.Tensor:
    """Sparse CSR (m, N) with ``values[n, j]`` at (idx[n, j], n): the transpose of the (N, m)
    matrix that scatters each row's k values to their concepts."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort()
    crow = torch.zeros(m + 1, dtype=torch.int64, device=idx.device)
    crow[1:] = torch.bincount(flat, minlength=m).cumsum(0)
    cols = torch.arange(N, device=idx.device).repeat_interleave(k)[order]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(crow, cols, values.reshape(-1)[order], (m, N), check_invariants=False)


class _TopkLinear(torch.autograd.Function):
    """Top-k of ``x @ w.T + b`` per row, differentiable in x, w and b through the k selected
    logits only.

    Forward scans the concepts in column chunks of ``chunk`` with a running top-k (memory
    O(N * (k + chunk)); one dense product when m <= chunk). Backward never forms (N, k, in)
    gathered weight rows (that gather, with its batched dot product, made the 2k/6k concept
    module +50% of a 25M training step in bf16): d/dx is a weighted bag of the k selected rows
    (embedding_bag), d/dw a sparse (m x N, N*k non-zeros) by dense product, d/db an index_add.
    Measured in benchmarks/model_step.py."""

    @staticmethod
    def forward(ctx, x, w, b, k: int, chunk: int):
        best_v = best_i = None
        for s in range(0, w.shape[0], chunk):
            z = x @ w[s:s + chunk].t().to(x.dtype)
            if b is not None:
                z = z + b[s:s + chunk].to(z.dtype)
            v, i = z.topk(min(k, z.shape[1]), dim=-1)
            if best_v is None:
                best_v, best_i = v, i
            else:
                v, sel = torch.cat([best_v, v], 1).topk(k, dim=-1)
                best_v, best_i = v, torch.cat([best_i, i + s], 1).gather(1, sel)
        ctx.save_for_backward(x, w, best_i)
        ctx.chunk, ctx.has_bias = chunk, b is not None
        ctx.mark_non_differentiable(best_i)
        return best_v, best_i

    @staticmethod
    def backward(ctx, g, _):
        x, w, idx = ctx.saved_tensors
        gx = gw = gb = None
        acc = torch.promote_types(g.dtype, torch.float32)  # bf16 gradients accumulate in fp32
        g = g.to(acc)
        if ctx.needs_input_grad[0]:
            gx = F.embedding_bag(idx, w, per_sample_weights=g.to(w.dtype), mode="sum").to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (_selection_matrix(idx, g, w.shape[0]) @ x.to(acc)).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device).index_add_(0, idx.reshape(-1),
                                                                                     g.reshape(-1).to(w.dtype))
        return gx, gw, gb, None, None


def _topk_logits(x: torch.Tensor, head_w: torch.Tensor, head_b: torch.Tensor | None, k: int,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, z): the k largest logits of ``x @ head_w.T + head_b`` per row, (N, k) each, z
    differentiable (``_TopkLinear``)."""
    z, idx = _TopkLinear.apply(x, head_w, head_b, k, chunk)
    return idx, z


class ConceptModule(nn.Module):
    """Known head f (d -> n) + n embeddings K; unknown head g factorised d -> R -> m, and m
    embeddings factorised U = coef (m x R) @ basis (R x d). With both unknown parts at rank
    R the parameter count matches the paper's Table 24 "+Concept" totals (e.g. 5B: +313M).

    Gradient routing (the public reference's; see model/README.md):
    * LM path  h_bar = k_hat + sg(u_hat) + eps,  eps = h - k_hat - sg(u_hat): h_bar == h, so
      the backbone gets exactly the LM gradient and the concept parameters get none from it,
      except on sequences whose eps is dropped (``eps_keep`` = 0, per-sequence eps-dropout),
      where h_bar = k_hat + sg(u_hat) and the LM loss trains the known head and K.
    * the unknown head reads sg(h); it is trained by the reconstruction loss only.
    """

    # above this many concepts, top-k is a chunked no-grad scan (bounds the (N, chunk) temporary)
    topk_chunk = 8192

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.known_head = nn.Linear(d, cfg.n_known)
        self.known_emb = nn.Parameter(torch.empty(cfg.n_known, d))
        self.unknown_proj = nn.Linear(d, cfg.unknown_rank, bias=False)  # g = unknown_head . unknown_proj
        self.unknown_head = nn.Linear(cfg.unknown_rank, cfg.n_unknown)
        self.unknown_coef = nn.Parameter(torch.empty(cfg.n_unknown, cfg.unknown_rank))
        self.unknown_basis = nn.Parameter(torch.empty(cfg.unknown_rank, d))

    def known_logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg.concept_logit_clamp
        return self.known_head(h).clamp(-c, c)

    def known_topk(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, clamped logits), (N, k_known) each, of the active known concepts."""
        c = self.cfg.concept_logit_clamp
        idx, z = _topk_logits(h, self.known_head.weight, self.known_head.bias, self.cfg.topk_known, self.topk_chunk)
        return idx, z.clamp(-c, c)

    def unknown_embeddings(self) -> torch.Tensor:
        """Dense U (m x d); only for analysis, training never materialises it."""
        return self.unknown_coef @ self.unknown_basis

    def known_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """k_hat for multi-hot labels (..., n): sum of the labelled concepts' embeddings."""
        return labels.to(self.known_emb.dtype) @ self.known_emb

    def unknown_part(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(idx, w, u_hat) of the unknown head on sg(h); U is never materialised (u_hat is a
        weighted sum of the k selected rows of coef, then one product with the basis)."""
        cfg = self.cfg
        p = self.unknown_proj(h.detach())  # (N, R)
        u_idx, u_z = _topk_logits(p, self.unknown_head.weight, self.unknown_head.bias, cfg.topk_unknown,
                                  self.topk_chunk)
        c = cfg.concept_logit_clamp
        u_w = torch.sigmoid(u_z.float().clamp(-c, c))
        u_low = F.embedding_bag(u_idx, self.unknown_coef, per_sample_weights=u_w.to(self.unknown_coef.dtype),
                                mode="sum")
        return u_idx, u_w, (u_low @ self.unknown_basis).to(h.dtype)

    def forward(self, h: torch.Tensor, known_logits: torch.Tensor | None = None,
                k_hat_teacher: torch.Tensor | None = None, teacher_weight: float = 0.0,
                eps_keep: torch.Tensor | None = None) -> ConceptOutput:
        """h (N, d). ``known_logits`` (N, n) may be passed when the caller already has the
        dense logits; otherwise top-k runs sparsely. ``eps_keep`` (N,) in {0, 1}: 0 drops
        the residual at that position (training-time eps-dropout)."""
        cfg = self.cfg
        if known_logits is not None:
            k_idx = known_logits.topk(cfg.topk_known, dim=-1).indices
            k_w = torch.sigmoid(known_logits.gather(1, k_idx).float())
        else:
            k_idx, k_z = self.known_topk(h)
            k_w = torch.sigmoid(k_z.float())
        # weighted row sums without a dense (N, n) activation matrix
        k_hat_pred = F.embedding_bag(k_idx, self.known_emb, per_sample_weights=k_w.to(self.known_emb.dtype),
                                     mode="sum")
        k_hat = k_hat_pred
        if k_hat_teacher is not None and teacher_weight > 0:
            k_hat = teacher_weight * k_hat_teacher.to(k_hat_pred.dtype) + (1 - teacher_weight) * k_hat_pred
        u_idx, u_w, u_hat = self.unknown_part(h)
        k_hat = k_hat.to(h.dtype)
        u_sg = u_hat.detach()  # the unknown part never carries LM gradient
        eps = h - k_hat - u_sg
        if eps_keep is not None:
            eps = eps * eps_keep.to(eps.dtype)[:, None]
        h_bar = k_hat + u_sg + eps
        return ConceptOutput(known_logits, k_idx, k_w, u_idx, u_w, k_hat, k_hat_pred.to(h.dtype), u_hat, eps, h_bar)


# ----------------------------------------------------------------------------- model
@dataclass
class Decomposition:
    """Exact split of logits at P positions: logit = sum(known) + unknown + residual."""

    token: torch.Tensor  # (P,) token whose logit is explained
    logit: torch.Tensor  # (P,) full-model logit of that token
    known_idx: torch.Tensor  # (P, k) active known concepts
    known: torch.Tensor  # (P, k) per-concept contribution k_i (K_i . W_y)
    unknown: torch.Tensor  # (P,) u_hat . W_y
    residual: torch.Tensor  # (P,) eps . W_y
    max_abs_error: float  # max |sum(known) + unknown + residual - logit|

    @property
    def known_total(self) -> torch.Tensor:
        return self.known.sum(-1)


class Steerling(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.concept = ConceptModule(cfg) if cfg.has_concepts else None
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._mask_cache: dict = {}
        self.reset_parameters()

    # -- init
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            elif name.endswith(("attn.out.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))  # residual branches
            elif "unknown_coef" in name:
                nn.init.normal_(p, std=1.0 / math.sqrt(self.cfg.unknown_rank))
            else:
                nn.init.normal_(p, std=std)

    @property
    def lm_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def _mask_info(self, T: int, device) -> tuple[str, object]:
        cfg = self.cfg
        if not cfg.is_diffusion:
            return ("causal", None)
        use_flex = cfg.attn_backend == "flex" or (cfg.attn_backend == "auto" and device.type == "cuda")
        key = (T, str(device), use_flex)
        if key not in self._mask_cache:
            if use_flex:
                from torch.nn.attention.flex_attention import create_block_mask

                bs = cfg.block_size

                def mask_mod(b, h, q, kv):
                    return q // bs >= kv // bs

                self._mask_cache[key] = ("flex", create_block_mask(mask_mod, None, None, T, T, device=device))
            else:
                self._mask_cache[key] = ("mask", block_causal_mask(T, cfg.block_size, device))
        return self._mask_cache[key]

    # -- forward pieces
    def hidden(self, idx: torch.Tensor, input_embeds: torch.Tensor | None = None, steer=None) -> torch.Tensor:
        """Final-normed hidden state h (B, T, d). ``input_embeds`` replaces the token lookup
        (used by Integrated Gradients over input embeddings). ``steer(i, x) -> x`` (optional,
        model/steering.py) edits the residual stream entering block i, and the final normed
        state as i == n_layers; None leaves the forward pass untouched."""
        B, T = idx.shape if input_embeds is None else input_embeds.shape[:2]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_emb(idx) if input_embeds is None else input_embeds
        device = x.device
        mask_info = self._mask_info(T, device)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for i, block in enumerate(self.blocks):
            if steer is not None:
                x = steer(i, x)
            x = block(x, cos, sin, mask_info)
        h = self.norm(x)
        return h if steer is None else steer(len(self.blocks), h)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.lm_weight.to(h.dtype).t()

    def forward(self, idx: torch.Tensor, return_concepts: bool = False, steer=None):
        """Logits (B, T, V) for every position; with ``return_concepts`` also the
        ConceptOutput over the flattened B*T positions (None for non-concept families).
        ``steer``: optional residual-stream hook, see ``hidden``."""
        h = self.hidden(idx, steer=steer)
        co = None
        if self.concept is not None:
            B, T, d = h.shape
            co = self.concept(h.reshape(B * T, d))
            h = co.h_bar.view(B, T, d)
        logits = self.lm_logits(h)
        return (logits, co) if return_concepts else logits

    # -- concept attribution
    @torch.no_grad()
    def decompose(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                  tokens: torch.Tensor | None = None, atol: float = 1e-4) -> Decomposition:
        """Exact logit decomposition for sequence ``idx`` (1, T) or (B, T).

        positions: (P, 2) [batch, pos] pairs or None for all; tokens: (P,) token to explain
        per position (default: the argmax). Computed in fp32; raises if the parts do not sum
        to the model's logit within ``atol``.
        """
        if self.concept is None:
            raise ValueError(f"family {self.cfg.family!r} has no concept module")
        h = self.hidden(idx).float()
        B, T, d = h.shape
        flat = h.reshape(B * T, d)
        if positions is not None:
            flat = flat[positions[:, 0] * T + positions[:, 1]]
        co = self.concept(flat)
        W = self.lm_weight.float()
        logits = co.h_bar @ W.t()
        if tokens is None:
            tokens = logits.argmax(-1)
        Wy = W[tokens]  # (P, d)
        logit = logits.gather(1, tokens[:, None]).squeeze(1)
        known = co.known_w * torch.einsum("pkd,pd->pk", self.concept.known_emb[co.known_idx].float(), Wy)
        unknown = (co.u_hat * Wy).sum(-1)
        residual = (co.eps * Wy).sum(-1)
        err = (known.sum(-1) + unknown + residual - logit).abs().max().item() if logit.numel() else 0.0
        if err > atol:
            raise AssertionError(f"logit decomposition error {err:.3g} > atol {atol}")
        return Decomposition(tokens, logit, co.known_idx, known, unknown, residual, err)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

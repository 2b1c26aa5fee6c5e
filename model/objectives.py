"""Training objectives: masked diffusion (CDLM), next token (AR), interpretability losses.

A batch is a dict of tensors:
  input_ids    (B, T) long   clean tokens
  chunk_ids    (B, T) long   index of each position's labelled chunk in chunk_labels, -1 = none
  chunk_labels (C, n) float  multi-hot known-concept labels per chunk   (concept families)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.config import ModelConfig, TrainConfig


# ----------------------------------------------------------------------------- diffusion
def sample_block_t(n: int, t_min: float, antithetic: bool = True, generator=None, device=None) -> torch.Tensor:
    """n masking rates in [t_min, 1].

    Antithetic / stratified: one uniform offset u, t_i = (u + i / n) mod 1 in random order,
    so the batch covers [0, 1) evenly (lower-variance loss than i.i.d. draws). The floor
    t_min keeps the 1/t weight bounded.
    """
    if antithetic:
        u = torch.rand((), generator=generator, device=device)
        t = (u + torch.arange(n, device=device) / n) % 1.0
        t = t[torch.randperm(n, generator=generator, device=device)]
    else:
        t = torch.rand(n, generator=generator, device=device)
    return t_min + (1.0 - t_min) * t


def corrupt(idx: torch.Tensor, cfg: ModelConfig, t_min: float = 1e-3, antithetic: bool = True, generator=None):
    """Mask each position of block b with probability t_b (one t per sequence and block).

    Returns (noisy_ids, mask (B, T) bool, t_pos (B, T) float = its block's t).
    """
    B, T = idx.shape
    nb = -(-T // cfg.block_size)
    t = sample_block_t(B * nb, t_min, antithetic, generator, idx.device).view(B, nb)
    t_pos = t.repeat_interleave(cfg.block_size, dim=1)[:, :T]
    mask = torch.rand(B, T, generator=generator, device=idx.device) < t_pos
    noisy = torch.where(mask, torch.full_like(idx, cfg.mask_token_id), idx)
    return noisy, mask, t_pos


def masked_diffusion_loss(logits: torch.Tensor, targets: torch.Tensor, t: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """sum over masked positions of CE / t, divided by the number of tokens in the batch.

    ``logits`` (M, V), ``targets`` (M,), ``t`` (M,) are the masked positions only; unmasked
    positions contribute nothing by construction (the estimator of the MDLM NELBO).
    """
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    return (ce / t).sum() / max(1, n_tokens)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


# ----------------------------------------------------------------------------- concepts
def chunk_log_not(known_logits: torch.Tensor, chunk_ids: torch.Tensor, n_chunks: int,
                  normalize: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """S (C, n) = -log prod_t (1 - k_t) over each chunk's positions (soft-OR, log space).

    log(1 - sigmoid(z)) = -softplus(z), so the product over a span is a sum of softplus —
    exact and stable for long spans. p(chunk has concept) = 1 - exp(-S).
    ``known_logits`` (..., n) and ``chunk_ids`` (...) cover the same positions (-1 = none).
    With ``normalize`` the sum is divided by sqrt(#positions of the chunk) (length
    normalisation: long or heavily-masked spans do not saturate p) and (S, count) returns.
    """
    flat_ids = chunk_ids.reshape(-1)
    z = known_logits.reshape(flat_ids.shape[0], -1).float()
    S = torch.zeros(n_chunks, z.shape[1], device=z.device, dtype=z.dtype)
    keep = flat_ids >= 0
    if not bool(keep.all()):
        flat_ids, z = flat_ids[keep], z[keep]
    S = S.index_add(0, flat_ids, F.softplus(z))
    if not normalize:
        return S
    count = torch.zeros(n_chunks, device=z.device, dtype=z.dtype).index_add(0, flat_ids, torch.ones_like(flat_ids, dtype=z.dtype))
    return S / count.clamp_min(1.0).sqrt()[:, None], count


def soft_or_bce(S: torch.Tensor, labels: torch.Tensor, pos_weight: float = 1.0) -> torch.Tensor:
    """Plain BCE of p = 1 - exp(-S) against chunk labels, mean over (chunk, concept).

    Kept for reference and tests: with sparse labels its minimum is near "nothing is
    present", which is why training uses ``balanced_soft_or_loss``."""
    labels = labels.to(S.dtype)
    neg = S  # -log(1 - p)
    pos = -torch.log(-torch.expm1(-S.clamp_min(1e-6)))  # -log p
    return (pos_weight * labels * pos + (1 - labels) * neg).mean()


def balanced_soft_or_loss(S: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None = None,
                          pos_weight: float = 1.0) -> torch.Tensor:
    """Concept loss that predicting "absent everywhere" cannot win.

    mean over positive (chunk, concept) pairs of -log p  +  mean over negative pairs of
    -log(1 - p): each class contributes on its own scale, however sparse the labels (with
    2% positives a plain mean is 98% negatives). ``valid`` (C,) drops chunks with no
    scored position (e.g. no masked token in a CDLM chunk)."""
    y = labels.to(S.dtype) > 0.5
    if valid is not None:
        y_v = y & valid[:, None]
        n_v = (~y) & valid[:, None]
    else:
        y_v, n_v = y, ~y
    pos = -torch.log(-torch.expm1(-S.clamp_min(1e-6)))  # -log p
    n_pos, n_neg = y_v.sum(), n_v.sum()
    pos_term = (pos * y_v).sum() / n_pos.clamp_min(1)
    neg_term = (S * n_v).sum() / n_neg.clamp_min(1)
    return pos_weight * pos_term + neg_term


def soft_or_probs(S: torch.Tensor) -> torch.Tensor:
    return -torch.expm1(-S)


def independence_loss(k_hat: torch.Tensor, u_hat: torch.Tensor) -> torch.Tensor:
    """||kc^T uc||_F^2 / (d^2 (N - 1)) over N positions (k_hat detached by the caller), with
    kc, uc the centred contributions: the normalisation the public re-implementation uses,
    so values are on the paper's scale (Table 5: 1.546 at 8B).

    Penalises linear predictability between the known and unknown contributions, so the
    unknown head cannot simply copy (or cancel) what the known head carries.
    """
    N, d = k_hat.shape
    if N < 2:
        return k_hat.new_zeros((), dtype=torch.float32)
    kc = k_hat - k_hat.mean(0)
    uc = u_hat - u_hat.mean(0)
    cross = (kc.t() @ uc).float()  # (d x d); the product runs in the autocast dtype
    return cross.pow(2).sum() / (d * d * (N - 1))


def reconstruction_loss(u_hat: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE(u_hat, target) with target = h - sg(k_hat): h stays attached, so the coverage
    term also pulls the backbone's h toward what the concept parts reconstruct, while the
    unknown head (which reads sg(h)) learns to reconstruct it. Equals mean ||eps||^2 / d
    when eps is not dropped."""
    return F.mse_loss(u_hat.float(), target.float())


def eps_keep_mask(B: int, p: float, generator=None, device=None) -> torch.Tensor | None:
    """Per-sequence eps-dropout: 1 keeps the residual, 0 drops it for the whole sequence
    (all-or-nothing per sequence, so the concept parts must carry those sequences alone)."""
    if p <= 0:
        return None
    return (torch.rand(B, generator=generator, device=device) >= p).float()


def concept_candidates(labels: torch.Tensor, n_neg: int, generator=None) -> torch.Tensor:
    """Known concepts scored by a bounded concept loss: every concept positive somewhere in
    the batch, plus ``n_neg`` uniformly sampled others. The negative term is a mean over
    negative pairs, so a uniform sample estimates it without bias."""
    pos = (labels > 0.5).any(0)
    pos_idx = pos.nonzero().squeeze(1)
    neg_pool = (~pos).nonzero().squeeze(1)
    if neg_pool.numel() > n_neg:
        pick = torch.randperm(neg_pool.numel(), generator=generator, device=labels.device)[:n_neg]
        neg_pool = neg_pool[pick]
    return torch.cat([pos_idx, neg_pool]).sort().values


# ----------------------------------------------------------------------------- all losses
def compute_losses(model, batch: dict, tcfg: TrainConfig, step: int = 0, total_steps: int | None = None,
                   generator: torch.Generator | None = None, teacher_weight: float | None = None,
                   return_parts: bool = False) -> dict:
    """Forward pass + every loss for one batch. Returns a dict with the differentiable
    total ``loss`` and detached parts. No backward, no optimizer: usable by any trainer.

    ``teacher_weight`` overrides the schedule (eval passes 0: the model's own concepts).
    eps-dropout is applied only in training mode (``model.training``). ``generator`` must
    live on the batch's device (or be None).
    """
    cfg: ModelConfig = model.cfg
    idx = batch["input_ids"]
    B, T = idx.shape
    if cfg.is_diffusion:
        x_in, sel, t_pos = corrupt(idx, cfg, tcfg.t_min, tcfg.antithetic_t, generator)
        targets = idx[sel]
        t_sel = t_pos[sel]
    else:
        x_in = idx
        sel = torch.zeros(B, T, dtype=torch.bool, device=idx.device)
        sel[:, :-1] = True
        targets = idx[:, 1:].reshape(-1)
    h = model.hidden(x_in)
    hs = h[sel]  # (M, d) positions that carry the LM loss (CDLM: the masked positions)
    out: dict = {}
    total = h.new_zeros((), dtype=torch.float32)
    co = None
    if cfg.has_concepts:
        cm = model.concept
        # h as the auxiliary losses see it: same value, gradient into the backbone scaled by
        # aux_backbone_grad (the heads still get their full gradient); see TrainConfig.
        a = getattr(tcfg, "aux_backbone_grad", 1.0)
        ha = hs if a >= 1 else hs.detach() + a * (hs - hs.detach()) if a > 0 else hs.detach()
        # Known logits at the LM positions only (CDLM: soft-OR over masked positions).
        labels = batch.get("chunk_labels")
        cand = None
        n_neg = getattr(tcfg, "concept_negatives", None)
        if n_neg is not None and model.training and labels is not None and n_neg < cfg.n_known:  # eval scores all
            cand = concept_candidates(labels, n_neg, generator)
            c = cfg.concept_logit_clamp
            known_sel = (ha @ cm.known_head.weight[cand].t().to(hs.dtype)
                         + cm.known_head.bias[cand].to(hs.dtype)).clamp(-c, c)  # (M, |cand|)
        else:
            known_sel = cm.known_logits(ha)  # (M, n): every concept gets a concept-loss gradient
        w = tcfg.teacher_forcing(step, total_steps) if teacher_weight is None else teacher_weight
        k_teacher = None
        chunk_ids = batch.get("chunk_ids")
        ids = chunk_ids[sel] if chunk_ids is not None else None
        if labels is not None and w > 0:
            per_chunk = cm.known_from_labels(labels)  # (C, d)
            k_teacher = torch.where((ids >= 0)[:, None], per_chunk[ids.clamp_min(0)], torch.zeros_like(per_chunk[:1]))
        keep = None
        p_eps = getattr(tcfg, "eps_dropout", 0.0)
        if model.training and p_eps > 0:
            seq_keep = eps_keep_mask(B, p_eps, generator, idx.device)
            keep = seq_keep[:, None].expand(B, T)[sel]
            out["eps_dropped_frac"] = float(1 - seq_keep.mean())
        co = cm(hs, known_logits=known_sel if cand is None else None, k_hat_teacher=k_teacher, teacher_weight=w,
                eps_keep=keep)
        rec = reconstruction_loss(co.u_hat, ha - co.k_hat.detach())
        indep = independence_loss(co.k_hat.detach(), co.u_hat)
        total = total + tcfg.rec_weight * rec + tcfg.indep_weight * indep
        out.update(rec_loss=rec.detach(), concept_independence_loss=indep.detach(), teacher_weight=float(w))
        hs = co.h_bar
        if labels is not None:
            S, count = chunk_log_not(known_sel, ids, labels.shape[0], normalize=True)
            closs = balanced_soft_or_loss(S, labels if cand is None else labels[:, cand], count > 0,
                                          tcfg.concept_pos_weight)
            total = total + tcfg.concept_weight * closs
            out["concept_loss"] = closs.detach()
            if return_parts:
                out["chunk_S"] = S.detach()
                out["chunk_valid"] = count > 0
    logits = model.lm_logits(hs)
    if cfg.is_diffusion:
        lm = masked_diffusion_loss(logits, targets, t_sel, B * T)
        out["mask_frac"] = float(sel.float().mean())
    else:
        lm = next_token_loss(logits, targets)
    total = total + lm
    out["lm_loss"] = lm.detach()
    out["loss"] = total
    if return_parts:
        out.update(logits=logits.detach(), targets=targets, concept_out=co)
    return out

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
def chunk_log_not(known_logits: torch.Tensor, chunk_ids: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """S (C, n) = -log prod_t (1 - k_t) over each chunk's positions (soft-OR, log space).

    log(1 - sigmoid(z)) = -softplus(z), so the product over a span is a sum of softplus —
    exact and stable for long spans. p(chunk has concept) = 1 - exp(-S).
    """
    flat_ids = chunk_ids.reshape(-1)
    z = known_logits.reshape(flat_ids.shape[0], -1).float()
    S = torch.zeros(n_chunks, z.shape[1], device=z.device, dtype=z.dtype)
    keep = flat_ids >= 0
    if bool(keep.all()):  # the usual packed batch: skip the boolean-index copies
        return S.index_add(0, flat_ids, F.softplus(z))
    return S.index_add(0, flat_ids[keep], F.softplus(z[keep]))


def soft_or_bce(S: torch.Tensor, labels: torch.Tensor, pos_weight: float = 1.0) -> torch.Tensor:
    """BCE of p = 1 - exp(-S) against chunk labels, mean over (chunk, concept)."""
    labels = labels.to(S.dtype)
    neg = S  # -log(1 - p)
    pos = -torch.log(-torch.expm1(-S.clamp_min(1e-6)))  # -log p
    return (pos_weight * labels * pos + (1 - labels) * neg).mean()


def soft_or_probs(S: torch.Tensor) -> torch.Tensor:
    return -torch.expm1(-S)


def independence_loss(k_hat: torch.Tensor, u_hat: torch.Tensor) -> torch.Tensor:
    """||Cov(k_hat, u_hat)||_F^2 / d^2 over N positions (k_hat detached by the caller).

    Penalises linear predictability between the known and unknown contributions, so the
    unknown head cannot simply copy (or cancel) what the known head carries.
    """
    N, d = k_hat.shape
    if N < 2:
        return k_hat.new_zeros(())
    kc = k_hat - k_hat.mean(0)
    uc = u_hat - u_hat.mean(0)
    cov = (kc.t() @ uc).float() / (N - 1)  # the (d x d) product runs in the autocast dtype
    return cov.pow(2).sum() / (d * d)


def reconstruction_loss(u_hat: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE(u_hat, h - k_hat) with the target detached: equals mean ||eps||^2 / d, so it is
    the coverage term that keeps the residual from absorbing the prediction."""
    return F.mse_loss(u_hat.float(), target.detach().float())


# ----------------------------------------------------------------------------- all losses
def compute_losses(model, batch: dict, tcfg: TrainConfig, step: int = 0, total_steps: int | None = None,
                   generator: torch.Generator | None = None, teacher_weight: float | None = None,
                   return_parts: bool = False) -> dict:
    """Forward pass + every loss for one batch. Returns a dict with the differentiable
    total ``loss`` and detached parts. No backward, no optimizer: usable by any trainer.

    ``teacher_weight`` overrides the schedule (eval passes 0: the model's own concepts).
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
    hs = h[sel]  # (M, d) positions that carry the LM loss
    out: dict = {}
    total = h.new_zeros((), dtype=torch.float32)
    co = None
    if cfg.has_concepts:
        cm = model.concept
        known_all = cm.known_logits(h)  # (B, T, n) dense: the concept loss needs every position
        w = tcfg.teacher_forcing(step, total_steps) if teacher_weight is None else teacher_weight
        k_teacher = None
        chunk_ids = batch.get("chunk_ids")
        labels = batch.get("chunk_labels")
        if labels is not None and w > 0:
            per_chunk = cm.known_from_labels(labels)  # (C, d)
            ids = chunk_ids[sel]
            k_teacher = torch.where((ids >= 0)[:, None], per_chunk[ids.clamp_min(0)], torch.zeros_like(per_chunk[:1]))
        co = cm(hs, known_logits=known_all[sel], k_hat_teacher=k_teacher, teacher_weight=w)
        rec = reconstruction_loss(co.u_hat, hs - co.k_hat)  # target h - k_hat (detached)
        hs = co.h_bar
        indep = independence_loss(co.k_hat.detach(), co.u_hat)
        total = total + tcfg.rec_weight * rec + tcfg.indep_weight * indep
        out.update(rec_loss=rec.detach(), concept_independence_loss=indep.detach(), teacher_weight=float(w))
        if labels is not None:
            S = chunk_log_not(known_all, chunk_ids, labels.shape[0])
            closs = soft_or_bce(S, labels, tcfg.concept_pos_weight)
            total = total + tcfg.concept_weight * closs
            out["concept_loss"] = closs.detach()
            if return_parts:
                out["chunk_S"] = S.detach()
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

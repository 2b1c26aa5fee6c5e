"""Interpretability metrics (paper Table 5/7/17) computed by the model package.

* Concept Loss              soft-OR chunk BCE of the known head (lower is better).
* Concept Independence Loss cross-covariance of k_hat and u_hat (lower is better).
* Concept Contribution      (|known| + |unknown|) / (|known| + |unknown| + |eps|) on the
                            target-token logit at LM-loss positions (higher is better).
* Known Concept Alignment   do the top tokens of W K_i match concept i's name: an
                            automatic proxy on the paper's 1-5 scale, plus a judge hook.
* Concept detection AUC     chunk-level soft-OR probability vs the chunk labels.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from scipy.stats import rankdata

from model.objectives import compute_losses, soft_or_probs


def auc(scores, labels) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged; nan if one class."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = rankdata(s)
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def concept_detection_auc(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Micro AUC over all (chunk, concept) pairs, and macro over concepts with both classes."""
    p, y = probs.detach().float().cpu().numpy(), labels.detach().cpu().numpy() > 0.5
    per = [auc(p[:, j], y[:, j]) for j in range(y.shape[1]) if 0 < y[:, j].sum() < y.shape[0]]
    return {"micro": auc(p, y), "macro": float(np.mean(per)) if per else float("nan")}


def concept_contribution(co, lm_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position share of the target logit carried by known + unknown (vs residual)."""
    Wy = lm_weight.float()[targets]
    k = (co.k_hat.float() * Wy).sum(-1).abs()
    u = (co.u_hat.float() * Wy).sum(-1).abs()
    e = (co.eps.float() * Wy).sum(-1).abs()
    return (k + u) / (k + u + e).clamp_min(1e-12)


@torch.no_grad()
def evaluate(model, batches: Sequence[dict], tcfg, seed: int = 1234, autocast=None) -> dict[str, float]:
    """Validation LM loss and (concept families) the concept metrics over fixed batches.

    Masks are drawn from a generator seeded with ``seed`` so repeated evals are comparable.
    Concepts are the model's own (teacher forcing off).
    """
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    lm, closs, indep, contrib, S_all, L_all = [], [], [], [], [], []
    for batch in batches:
        ctx = autocast() if autocast is not None else _null()
        with ctx:
            out = compute_losses(model, batch, tcfg, generator=gen, teacher_weight=0.0, return_parts=True)
        lm.append(float(out["lm_loss"]))
        co = out.get("concept_out")
        if co is not None:
            indep.append(float(out["concept_independence_loss"]))
            contrib.append(concept_contribution(co, model.lm_weight, out["targets"]))
            if "concept_loss" in out:
                closs.append(float(out["concept_loss"]))
                S_all.append(out["chunk_S"].float())
                L_all.append(batch["chunk_labels"])
    model.train(was_training)
    res = {"val_loss": float(np.mean(lm))}
    if contrib:
        res["concept_independence_loss"] = float(np.mean(indep))
        res["concept_contribution"] = float(torch.cat(contrib).mean())
    if S_all:
        res["concept_loss"] = float(np.mean(closs))
        a = concept_detection_auc(soft_or_probs(torch.cat(S_all)), torch.cat(L_all))
        res["concept_auc"], res["concept_auc_macro"] = a["micro"], a["macro"]
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ----------------------------------------------------------------------------- alignment
@torch.no_grad()
def concept_top_tokens(model, k: int = 20) -> torch.Tensor:
    """(n_known, k) token ids with the largest W K_i (what each concept pushes up)."""
    scores = model.concept.known_emb.float() @ model.lm_weight.float().t()
    return scores.topk(k, dim=-1).indices


def _name_token_ids(tokenizer, name: str) -> set[int]:
    ids = set()
    for variant in (name, " " + name, name.capitalize(), " " + name.capitalize()):
        enc = tokenizer.encode(variant, add_special_tokens=False).ids
        if enc:
            ids.add(enc[0])  # first sub-token of the word: what a direction must promote
    return ids


@torch.no_grad()
def known_concept_alignment(model, tokenizer, concept_names: Sequence[str], top_k: int = 20,
                            judge: Callable[[str, list[str]], float] | None = None,
                            concepts: Sequence[int] | None = None) -> dict:
    """Known Concept Alignment.

    Proxy (automatic): for concept i, r_i = best rank of any first sub-token of i's name
    (with/without leading space or capital) in the scores W K_i; percentile
    q_i = 1 - r_i / V; reported on the paper's 1-5 scale as 1 + 4 q_i, plus hit@top_k.
    Judge hook: ``judge(name, top_tokens) -> rating in [1, 5]`` (an LLM or a human); its
    mean is reported as ``judge_mean`` when given.
    """
    scores = model.concept.known_emb.float() @ model.lm_weight.float().t()  # (n, V)
    V = scores.shape[1]
    idx = list(concepts) if concepts is not None else [i for i, n in enumerate(concept_names) if n]
    order = scores.argsort(dim=-1, descending=True)
    rank_of = torch.empty_like(order)
    proxy, hits, ratings, tops = [], [], [], {}
    for i in idx:
        name = concept_names[i]
        rank_of[i, order[i]] = torch.arange(V)
        ids = _name_token_ids(tokenizer, name)
        r = min(int(rank_of[i, t]) for t in ids) if ids else V - 1
        q = 1.0 - r / (V - 1)
        proxy.append(1.0 + 4.0 * q)
        hits.append(float(r < top_k))
        top = [tokenizer.decode([int(t)]) for t in order[i, :top_k]]
        tops[name] = top
        if judge is not None:
            ratings.append(float(judge(name, top)))
    res = {"proxy_score": float(np.mean(proxy)) if proxy else float("nan"),
           "hit_at_k": float(np.mean(hits)) if hits else float("nan"), "top_tokens": tops}
    if judge is not None:
        res["judge_mean"] = float(np.mean(ratings)) if ratings else float("nan")
    return res

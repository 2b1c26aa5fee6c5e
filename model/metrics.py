"""Interpretability metrics (paper Table 5/7/17) computed by the model package.

* Concept Loss              soft-OR chunk BCE of the known head (lower is better).
* Concept Independence Loss cross-covariance of k_hat and u_hat (lower is better).
* Concept Contribution      (|known| + |unknown|) / (|known| + |unknown| + |eps|) on the
                            target-token logit at LM-loss positions (higher is better).
* Known Concept Alignment   the paper's metric: a judge (LLM or human) rates 1-5 how well
                            the top tokens of W K_i fit concept i's name
                            (``known_concept_alignment`` with a judge callable;
                            ``engine_judge`` adapts an Atlas engine backend).
* Concept rank alignment    NOT the paper's metric: an automatic, chance-calibrated rank
                            proxy (``concept_rank_alignment``): 0 = chance, 1 = the name's
                            token is the top token of W K_i.
* Concept detection AUC     chunk-level soft-OR probability vs the chunk labels.
"""

from __future__ import annotations

import math
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
    """Micro AUC over all (chunk, concept) pairs, macro over concepts with both classes, and
    the micro AUC's base-rate control: every chunk scored with each concept's frequency in
    ``labels``. Micro AUC rewards knowing which concepts are common, so it reads high for a
    model that knows nothing else when frequencies are skewed; macro is 0.5 for such a model."""
    p, y = probs.detach().float().cpu().numpy(), labels.detach().cpu().numpy() > 0.5
    per = [auc(p[:, j], y[:, j]) for j in range(y.shape[1]) if 0 < y[:, j].sum() < y.shape[0]]
    base = np.broadcast_to(y.mean(0, keepdims=True), y.shape)
    return {"micro": auc(p, y), "macro": float(np.mean(per)) if per else float("nan"), "micro_base_rate": auc(base, y)}


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
    device = batches[0]["input_ids"].device if batches else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)  # CUDA sampling needs a CUDA generator
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
                valid = out["chunk_valid"]  # chunks with no scored position carry no evidence
                S_all.append(out["chunk_S"].float()[valid])
                L_all.append(batch["chunk_labels"][valid])
    model.train(was_training)
    res = {"val_loss": float(np.mean(lm))}
    if contrib:
        res["concept_independence_loss"] = float(np.mean(indep))
        res["concept_contribution"] = float(torch.cat(contrib).mean())
    if S_all:
        res["concept_loss"] = float(np.mean(closs))
        a = concept_detection_auc(soft_or_probs(torch.cat(S_all)), torch.cat(L_all))
        res["concept_auc"], res["concept_auc_macro"] = a["micro"], a["macro"]
        res["concept_auc_base_rate"] = a["micro_base_rate"]
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


def chance_best_rank_quantile(V: int, j: int) -> float:
    """E[1 - r / (V - 1)] when r is the best (0-based) rank of j tokens in a random order of
    V: E[r] = (V - j) / (j + 1)."""
    return 1.0 - (V - j) / ((j + 1) * (V - 1))


def calibrate(q: float, q_chance: float) -> float:
    """(q - q_chance) / (1 - q_chance): 0 at chance, 1 at perfect, negative below chance."""
    return (q - q_chance) / (1.0 - q_chance) if q_chance < 1 else float("nan")


@torch.no_grad()
def concept_rank_alignment(model, tokenizer, concept_names: Sequence[str], top_k: int = 20,
                           concepts: Sequence[int] | None = None) -> dict:
    """Automatic rank proxy for alignment — NOT the paper's judged Known Concept Alignment.

    For concept i, r_i = best rank of any first sub-token of i's name (with/without
    leading space or capital) in the scores W K_i; quantile q_i = 1 - r_i / (V - 1).
    Reported calibrated against chance, (q - q_chance) / (1 - q_chance), so 0 means "no
    better than a random direction" (a raw quantile of a random direction is ~0.5, which
    on a 1-5 rescale would read as a respectable 3). hit@top_k is reported beside its
    chance rate.
    """
    scores = model.concept.known_emb.float() @ model.lm_weight.float().t()  # (n, V)
    V = scores.shape[1]
    idx = list(concepts) if concepts is not None else [i for i, n in enumerate(concept_names) if n]
    order = scores.argsort(dim=-1, descending=True)
    q, q0, hits, hits0 = [], [], [], []
    for i in idx:
        rank_of = torch.empty(V, dtype=torch.long)
        rank_of[order[i]] = torch.arange(V)
        ids = _name_token_ids(tokenizer, concept_names[i])
        if not ids:
            continue
        r = min(int(rank_of[t]) for t in ids)
        q.append(1.0 - r / (V - 1))
        q0.append(chance_best_rank_quantile(V, len(ids)))
        hits.append(float(r < top_k))
        hits0.append(1.0 - math.comb(V - len(ids), top_k) / math.comb(V, top_k))
    if not q:
        return {"rank_alignment": float("nan"), "quantile": float("nan"), "quantile_chance": float("nan"),
                "hit_at_k": float("nan"), "hit_at_k_chance": float("nan"), "n": 0}
    qm, q0m = float(np.mean(q)), float(np.mean(q0))
    return {"rank_alignment": calibrate(qm, q0m), "quantile": qm, "quantile_chance": q0m,
            "hit_at_k": float(np.mean(hits)), "hit_at_k_chance": float(np.mean(hits0)), "n": len(q)}


def _judge_all(judge, items: list[tuple[str, list[str]]]) -> list[float]:
    many = getattr(judge, "many", None)
    return [float(r) for r in many(items)] if many is not None else [float(judge(n, t)) for n, t in items]


@torch.no_grad()
def known_concept_alignment(model, tokenizer, concept_names: Sequence[str],
                            judge: Callable[[str, list[str]], float], top_k: int = 20,
                            concepts: Sequence[int] | None = None) -> dict:
    """Known Concept Alignment as the paper defines it: a judge rates, 1-5, how well the
    ``top_k`` tokens of W K_i fit concept i's name; the mean rating is the metric.

    ``judge(name, top_tokens) -> rating`` is an LLM or a human; a judge with a
    ``many(items)`` method is called once for all concepts (``engine_judge`` does that).
    Returns ``{"known_concept_alignment": mean, "ratings": {...}, "top_tokens": {...}}``.
    """
    if judge is None:
        raise ValueError("known_concept_alignment needs a judge; concept_rank_alignment is the automatic proxy")
    tops_ids = concept_top_tokens(model, top_k)
    idx = list(concepts) if concepts is not None else [i for i, n in enumerate(concept_names) if n]
    items = [(concept_names[i], [tokenizer.decode([int(t)]) for t in tops_ids[i]]) for i in idx]
    ratings = _judge_all(judge, items)
    for (name, _), r in zip(items, ratings):
        if not 1.0 <= r <= 5.0:
            raise ValueError(f"judge rating {r} for concept {name!r} is outside [1, 5]")
    return {"known_concept_alignment": float(np.mean(ratings)) if ratings else float("nan"),
            "ratings": {n: r for (n, _), r in zip(items, ratings)}, "top_tokens": dict(items)}


JUDGE_PROMPT = (
    "A language model has a direction for the concept \"{name}\". The words it pushes up most are:\n"
    "{tokens}\n"
    "How well do these words fit the concept? Rate from 1 (unrelated) to 5 (clearly the concept).\n"
    "Answer with one digit.\nRating:"
)


class engine_judge:
    """Judge callable over an Atlas engine backend (``atlas.engine.make_backend``): one
    constrained generation per concept (choice of "1".."5"), batched by ``many``.

    ``template`` renders a chat prompt for instruct models (``Engine.chat_template``)."""

    def __init__(self, backend, template: Callable[[list[dict]], str] | None = None):
        from atlas.engine import Sampling

        self.backend, self.template = backend, template
        self.sampling = Sampling(max_tokens=2, temperature=0.0, choice=("1", "2", "3", "4", "5"))

    def _prompt(self, name: str, top: list[str]) -> str:
        text = JUDGE_PROMPT.format(name=name, tokens=", ".join(repr(t.strip()) for t in top))
        return self.template([{"role": "user", "content": text}]) if self.template else text

    def many(self, items: list[tuple[str, list[str]]]) -> list[float]:
        results = self.backend.generate([self._prompt(n, t) for n, t in items], self.sampling)
        out = []
        for (name, _), r in zip(items, results):
            if r.error or not r.text or not r.text.strip()[:1].isdigit():
                raise RuntimeError(f"judge failed for concept {name!r}: {r.error or repr(r.text)}")
            out.append(float(r.text.strip()[0]))
        return out

    def __call__(self, name: str, top: list[str]) -> float:
        return self.many([(name, top)])[0]

"""Concept steering without retraining: layer injection of concept-embedding directions.

A steering request maps concepts (known ids, known names, or "unknown:<j>") to strengths in
logit units. Concepts sharing a strength form one group; a group's direction is the
normalised sum of their embeddings, and its scale is alpha = strength / max_y (W_y . dir),
so injecting it into the final hidden state raises the most-aligned token's logit by exactly
``strength`` (negative strength = suppression: the direction is subtracted).

The delta is added to the residual stream entering every block i >= ``layer`` and to the
final normed hidden state (``layer == n_layers``: only there, the exact-logit-units case),
at the positions being generated: still-[MASK] positions for the diffusion families, the
last (next-token) position for the autoregressive ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.sampling import generate


def concept_vector(model, concept, names: list[str] | None = None) -> torch.Tensor:
    """Embedding (d,) of a known concept (id or name) or an unknown one ("unknown:<j>")."""
    cm = model.concept
    if cm is None:
        raise ValueError(f"family {model.cfg.family!r} has no concept module to steer with")
    if isinstance(concept, str) and concept.startswith("unknown:"):
        j = int(concept.split(":", 1)[1])
        if not 0 <= j < model.cfg.n_unknown:
            raise ValueError(f"unknown concept {j} out of range [0, {model.cfg.n_unknown})")
        return (cm.unknown_coef[j] @ cm.unknown_basis).detach().float()
    return cm.known_emb[resolve_concept(concept, names, model.cfg.n_known)].detach().float()


def resolve_concept(concept, names: list[str] | None, n_known: int) -> int:
    """Known concept id from an int, a digit string, a name, or "known:<i>"."""
    if isinstance(concept, str) and concept.startswith("known:"):
        concept = concept.split(":", 1)[1]
    if isinstance(concept, int) or (isinstance(concept, str) and concept.isdigit()):
        i = int(concept)
    else:
        lowered = [n.lower() for n in (names or [])]
        if concept.lower() not in lowered:
            near = [n for n in (names or []) if n and concept.lower()[:3] in n.lower()][:5]
            raise KeyError(f"no known concept named {concept!r}" + (f"; similar: {near}" if near else ""))
        i = lowered.index(concept.lower())
    if not 0 <= i < n_known:
        raise KeyError(f"known concept id {i} out of range [0, {n_known})")
    return i


def logit_gain(model, direction: torch.Tensor) -> float:
    """max_y W_y . dir: the largest logit change a unit step along ``direction`` causes."""
    return float((model.lm_weight.detach().float() @ direction.to(model.lm_weight.device)).max())


@dataclass
class Steering:
    """A residual-stream delta and where to add it; ``hook_for(ids)`` feeds Steerling.forward."""

    delta: torch.Tensor  # (d,) sum of alpha_g * dir_g
    layer: int
    diffusion: bool
    mask_id: int
    groups: list[dict] = field(default_factory=list)  # per group: concepts, strength, alpha, gain

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: positions being generated for input ``ids``."""
        if self.diffusion:
            return ids == self.mask_id
        where = torch.zeros_like(ids, dtype=torch.bool)
        where[:, -1] = True
        return where

    def hook_for(self, ids: torch.Tensor):
        where = self.positions(ids)[..., None]
        delta = self.delta.to(ids.device)

        def hook(i: int, x: torch.Tensor) -> torch.Tensor:
            if i < self.layer:
                return x
            return x + where.to(x.dtype) * delta.to(x.dtype)

        return hook

    def __call__(self, ids: torch.Tensor):  # the ``steer`` callable sampling.generate expects
        return self.hook_for(ids)

    def scaled(self, factor: float) -> "Steering":
        return Steering(self.delta * factor, self.layer, self.diffusion, self.mask_id,
                        [{**g, "strength": g["strength"] * factor, "alpha": g["alpha"] * factor} for g in self.groups])


def make_steering(model, concepts: dict, names: list[str] | None = None, layer: int | None = None) -> Steering:
    """Build a Steering from {concept: strength in logit units} (negative = suppress).

    ``layer`` defaults to n_layers (final hidden state only: strengths are exact logit units).
    """
    if not concepts:
        raise ValueError("no concepts to steer")
    L = model.cfg.n_layers if layer is None else int(layer)
    if not 0 <= L <= model.cfg.n_layers:
        raise ValueError(f"layer {L} out of range [0, {model.cfg.n_layers}]")
    by_strength: dict[float, list] = {}
    for c, s in concepts.items():
        by_strength.setdefault(float(s), []).append(c)
    delta = torch.zeros(model.cfg.d_model)
    groups = []
    for strength, cs in by_strength.items():
        direction = sum(concept_vector(model, c, names).cpu() for c in cs)
        norm = float(direction.norm())
        if norm == 0:
            raise ValueError(f"concepts {cs} have a zero embedding sum")
        direction = direction / norm
        gain = logit_gain(model, direction)
        if gain <= 0:
            raise ValueError(f"direction of {cs} raises no token's logit (max W.dir = {gain:.3g})")
        alpha = strength / gain
        delta += alpha * direction
        groups.append({"concepts": [str(c) for c in cs], "strength": strength, "alpha": alpha, "gain": gain})
    return Steering(delta.to(model.lm_weight.device), L, model.cfg.is_diffusion, model.cfg.mask_token_id, groups)


def random_steering(model, like: Steering, seed: int = 0) -> Steering:
    """Control: a random direction with the same norm as ``like``'s delta, same layer."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(model.cfg.d_model, generator=g)
    r = r / r.norm() * float(like.delta.norm().cpu())
    return Steering(r.to(like.delta.device), like.layer, like.diffusion, like.mask_id,
                    [{"concepts": ["random"], "strength": None, "alpha": float(like.delta.norm()), "gain": None}])


def steered_generate(model, prompt: torch.Tensor, max_new_tokens: int, steering: Steering | None, **kw) -> torch.Tensor:
    """``sampling.generate`` with the steering hook on every model call."""
    return generate(model, prompt, max_new_tokens, steer=steering, **kw)

"""Which parameters get gradient from which loss (the reference's routing, model/README.md).

Each test switches on one loss (the others weighted 0) and pins the set of parameters with
a non-zero gradient, so a change to the detach / eps logic shows up here.
"""

import pytest
import torch

from model.config import ModelConfig, TrainConfig
from model.modeling import Steerling
from model.objectives import compute_losses

KNOWN = {"concept.known_head.weight", "concept.known_head.bias", "concept.known_emb"}
UNKNOWN = {"concept.unknown_proj.weight", "concept.unknown_head.weight", "concept.unknown_head.bias",
           "concept.unknown_coef", "concept.unknown_basis"}


def _setup(family="cdlm_concept"):
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family=family, attn_backend="sdpa")).train()
    with torch.no_grad():  # non-trivial concept parts so every path carries signal
        model.concept.known_emb.mul_(10)
        model.concept.unknown_basis.mul_(5)
    B, T, nc = 4, 64, 4
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(5, 1000, (B, T), generator=g),
             "chunk_ids": torch.arange(B * nc).view(B, nc).repeat_interleave(T // nc, dim=1),
             "chunk_labels": (torch.rand(B * nc, model.cfg.n_known, generator=g) < 0.2).float()}
    return model, batch


def _grads(model, batch, teacher_weight=0.0, **weights):
    tc = TrainConfig(steps=10, dtype="fp32", **{"concept_weight": 0.0, "rec_weight": 0.0, "indep_weight": 0.0,
                                                "eps_dropout": 0.0, **weights})
    model.zero_grad(set_to_none=True)
    out = compute_losses(model, batch, tc, step=0, teacher_weight=teacher_weight,
                         generator=torch.Generator().manual_seed(0))
    out["loss"].backward()
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def _nonzero(grads) -> set[str]:
    return {n for n, g in grads.items() if g.abs().sum() > 0}


def _extra(model, batch, **weights) -> set[str]:
    """Parameters whose gradient changes when the given losses are added to the LM loss
    (the LM loss is always part of the objective, so its gradient is subtracted)."""
    base = _grads(model, batch)
    g = _grads(model, batch, **weights)
    return {n for n in g if (g[n] - base[n]).abs().max() > 1e-6 * (1 + base[n].abs().max())}


def _backbone(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if not n.startswith("concept.")}


@pytest.mark.parametrize("family", ["cdlm_concept", "ar_concept"])
def test_lm_loss_gives_the_backbone_exactly_the_plain_lm_gradient(family):
    model, batch = _setup(family)
    g = _grads(model, batch, teacher_weight=0.5)
    assert _nonzero(g) == _backbone(model)  # no concept parameter is trained by the LM loss
    # same gradient as the backbone alone (h -> W h): build that loss by hand
    model.zero_grad(set_to_none=True)
    from model.objectives import corrupt, masked_diffusion_loss, next_token_loss
    idx = batch["input_ids"]
    if model.cfg.is_diffusion:
        x, sel, t = corrupt(idx, model.cfg, 1e-3, True, torch.Generator().manual_seed(0))
        lm = masked_diffusion_loss(model.lm_logits(model.hidden(x)[sel]), idx[sel], t[sel], idx.numel())
    else:
        lm = next_token_loss(model.lm_logits(model.hidden(idx)[:, :-1].reshape(-1, model.cfg.d_model)),
                             idx[:, 1:].reshape(-1))
    lm.backward()
    for n, p in model.named_parameters():
        if n in _backbone(model):
            assert torch.allclose(g[n], p.grad, atol=1e-6, rtol=1e-4), n


def test_eps_dropout_trains_known_part_from_lm_but_never_unknown():
    model, batch = _setup()
    nz = _extra(model, batch, eps_dropout=0.99)  # every sequence dropped (p < 1 by config)
    assert KNOWN <= nz  # k_hat carries the LM loss of dropped sequences
    assert not (UNKNOWN & nz)  # the unknown part is detached in the LM path
    assert "blocks.0.attn.qkv.weight" in nz  # LM gradient now also reaches h via the known head
    # eval mode never drops eps: the LM path is h again
    model.eval()
    g_eval = _grads(model, batch, eps_dropout=0.99)
    assert _nonzero(g_eval) == _backbone(model)


def test_reconstruction_trains_unknown_head_and_pushes_backbone_not_known():
    model, batch = _setup()
    nz = _extra(model, batch, rec_weight=1.0)
    assert UNKNOWN <= nz
    assert not (KNOWN & nz)  # target h - sg(k_hat)
    assert "blocks.0.attn.qkv.weight" in nz and "norm.weight" in nz  # h attached in the target


def test_concept_loss_trains_known_head_and_backbone_only():
    model, batch = _setup()
    nz = _extra(model, batch, concept_weight=1.0)
    assert {"concept.known_head.weight", "concept.known_head.bias"} <= nz
    assert "concept.known_emb" not in nz and not (UNKNOWN & nz)
    assert "blocks.0.mlp.up.weight" in nz  # the backbone learns to expose the concepts


def test_independence_trains_only_the_unknown_side():
    model, batch = _setup()
    nz = _extra(model, batch, indep_weight=1.0)
    assert nz and nz <= UNKNOWN  # k_hat detached, unknown head reads sg(h)


def test_full_objective_reaches_every_parameter_with_eps_dropout():
    model, batch = _setup()
    g = _grads(model, batch, teacher_weight=0.5, concept_weight=1.0, rec_weight=1.0, indep_weight=1.0,
               eps_dropout=0.5)
    assert _nonzero(g) == {n for n, _ in model.named_parameters()}


def test_aux_backbone_grad_scales_only_the_backbone_share_of_the_auxiliary_losses():
    model, batch = _setup()
    aux = dict(concept_weight=1.0, rec_weight=1.0)
    assert not (_extra(model, batch, aux_backbone_grad=0.0, **aux) & _backbone(model))  # backbone: LM only
    base = _grads(model, batch)
    full, half = _grads(model, batch, **aux), _grads(model, batch, aux_backbone_grad=0.5, **aux)
    for n in _backbone(model):  # half the auxiliary gradient reaches the backbone
        assert torch.allclose(half[n] - base[n], 0.5 * (full[n] - base[n]), atol=1e-6, rtol=1e-3), n
    for n in KNOWN | UNKNOWN:  # the heads learn at full weight
        assert torch.allclose(half[n], full[n], atol=1e-6, rtol=1e-4), n

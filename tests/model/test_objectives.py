import math

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig, TrainConfig
from model.modeling import Steerling
from model.objectives import (chunk_log_not, compute_losses, corrupt, independence_loss, masked_diffusion_loss,
                              sample_block_t, soft_or_bce, soft_or_probs)


def test_masked_diffusion_loss_hand_built():
    # 2 masked positions out of a 4-token batch, vocab 3
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    targets = torch.tensor([0, 2])
    t = torch.tensor([0.5, 0.25])
    ce0 = -(2.0 - math.log(math.exp(2) + 2))
    ce1 = -(0.0 - math.log(math.e + 2))
    expected = (ce0 / 0.5 + ce1 / 0.25) / 4
    assert masked_diffusion_loss(logits, targets, t, n_tokens=4).item() == pytest.approx(expected, rel=1e-6)
    # halving t doubles the loss: the 1/t weight
    assert masked_diffusion_loss(logits, targets, t / 2, 4).item() == pytest.approx(2 * expected, rel=1e-6)


def test_sample_t_antithetic_and_floor():
    t = sample_block_t(10, t_min=0.1, antithetic=True, generator=torch.Generator().manual_seed(3))
    assert (t >= 0.1).all() and (t <= 1).all()
    raw = ((t - 0.1) / 0.9).sort().values
    gaps = torch.diff(raw)
    assert torch.allclose(gaps, torch.full_like(gaps, 0.1), atol=1e-5)  # one draw per stratum


def test_corrupt_masks_per_block_with_rate_t():
    cfg = ModelConfig.preset("tiny", family="cdlm", block_size=16, max_seq_len=128)
    idx = torch.randint(5, 1000, (64, 128))
    noisy, mask, t = corrupt(idx, cfg, t_min=1e-3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(noisy[~mask], idx[~mask])
    assert (noisy[mask] == cfg.mask_token_id).all()
    tb = t.view(64, 8, 16)
    assert (tb == tb[..., :1]).all()  # one t per block
    rate = mask.float().mean()
    assert abs(rate - t.mean()) < 0.03


def test_compute_losses_only_masked_positions_and_1_over_t():
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm")).eval()
    tc = TrainConfig(steps=1)
    idx = torch.randint(5, 1000, (2, 64))
    out = compute_losses(model, {"input_ids": idx}, tc, generator=torch.Generator().manual_seed(7))
    noisy, mask, t = corrupt(idx, model.cfg, tc.t_min, tc.antithetic_t, torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(noisy)
    ce = F.cross_entropy(logits[mask].float(), idx[mask], reduction="none")
    manual = (ce / t[mask]).sum() / idx.numel()
    assert out["lm_loss"].item() == pytest.approx(manual.item(), rel=1e-4)
    # targets at unmasked positions do not enter the loss
    assert 0 < mask.sum() < mask.numel()


def test_ar_loss_is_next_token_ce():
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="ar")).eval()
    idx = torch.randint(5, 1000, (2, 32))
    out = compute_losses(model, {"input_ids": idx}, TrainConfig(steps=1))
    with torch.no_grad():
        logits = model(idx)
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))
    assert out["lm_loss"].item() == pytest.approx(ref.item(), rel=1e-5)


def test_soft_or_matches_product_form():
    torch.manual_seed(0)
    z = torch.randn(2, 6, 3)  # (B, T, n)
    chunk_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 3, 3, 3]])
    S = chunk_log_not(z, chunk_ids, 4)
    k = torch.sigmoid(z)
    p0 = 1 - (1 - k[0, :3]).prod(0)
    p3 = 1 - (1 - k[1, 3:]).prod(0)
    assert torch.allclose(soft_or_probs(S)[0], p0, atol=1e-6)
    assert torch.allclose(soft_or_probs(S)[3], p3, atol=1e-6)
    labels = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]])
    p = soft_or_probs(S)
    ref = F.binary_cross_entropy(p, labels)
    assert soft_or_bce(S, labels).item() == pytest.approx(ref.item(), rel=1e-5)


def test_independence_loss():
    torch.manual_seed(0)
    k = torch.randn(256, 8)
    assert independence_loss(k, torch.ones(256, 8)).item() == pytest.approx(0.0, abs=1e-10)
    same = independence_loss(k, k).item()
    indep = independence_loss(k, torch.randn(256, 8)).item()
    assert same > 10 * indep > 0


def test_concept_losses_present_and_teacher_forcing_changes_k_hat():
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm_concept"))
    B, T = 2, 64
    batch = {"input_ids": torch.randint(5, 1000, (B, T)),
             "chunk_ids": torch.arange(B * 2).view(B, 2).repeat_interleave(32, 1),
             "chunk_labels": (torch.rand(B * 2, 32) < 0.3).float()}
    tc = TrainConfig(steps=10)
    a = compute_losses(model, batch, tc, teacher_weight=1.0, generator=torch.Generator().manual_seed(0), return_parts=True)
    b = compute_losses(model, batch, tc, teacher_weight=0.0, generator=torch.Generator().manual_seed(0), return_parts=True)
    for key in ("concept_loss", "rec_loss", "concept_independence_loss", "lm_loss"):
        assert torch.isfinite(a[key])
    assert not torch.allclose(a["concept_out"].k_hat, b["concept_out"].k_hat)
    assert torch.allclose(b["concept_out"].k_hat, b["concept_out"].k_hat_pred)
    # teacher-forced k_hat is the sum of the labelled concepts' embeddings
    lab = batch["chunk_labels"][0] @ model.concept.known_emb
    assert torch.allclose(a["concept_out"].k_hat[0], lab, atol=1e-5)  # seed 0: first masked position is in chunk 0


def test_balanced_concept_loss_cannot_be_won_by_predicting_nothing():
    from model.objectives import balanced_soft_or_loss
    labels = torch.zeros(50, 40)
    labels[torch.arange(50), torch.arange(50) % 40] = 1  # 2.5% positives
    S_nothing = torch.full((50, 40), 1e-4)  # p ~ 0 everywhere
    S_right = torch.where(labels > 0, torch.tensor(5.0), torch.tensor(1e-3))
    plain_nothing = soft_or_bce(S_nothing, labels).item()
    assert plain_nothing < 0.3  # the plain mean barely punishes "nothing is present"
    assert balanced_soft_or_loss(S_nothing, labels).item() > 9  # -log(1e-4) on the positive half
    assert balanced_soft_or_loss(S_right, labels).item() < 0.02
    # chunks without scored positions are ignored
    valid = torch.ones(50, dtype=torch.bool)
    valid[0] = False
    S_bad0 = S_right.clone()
    S_bad0[0] = 1e-4
    assert balanced_soft_or_loss(S_bad0, labels, valid).item() == pytest.approx(
        balanced_soft_or_loss(S_right, labels, valid).item(), rel=1e-6)


def test_soft_or_length_normalisation():
    z = torch.full((1, 8, 2), -1.0)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1]])
    S, count = chunk_log_not(z, ids, 2, normalize=True)
    sp = F.softplus(torch.tensor(-1.0))
    assert count.tolist() == [4.0, 2.0]
    assert torch.allclose(S[0], 4 * sp / 2) and torch.allclose(S[1], 2 * sp / math.sqrt(2))


def test_independence_normalised_by_d2_n_minus_1():
    torch.manual_seed(0)
    k, u = torch.randn(100, 4), torch.randn(100, 4)
    kc, uc = k - k.mean(0), u - u.mean(0)
    assert independence_loss(k, u).item() == pytest.approx(((kc.t() @ uc) ** 2).sum().item() / (16 * 99), rel=1e-5)


def test_bounded_negatives_score_positives_and_a_sample():
    from model.objectives import concept_candidates
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm_concept", n_known=64)).train()
    B, T = 2, 64
    labels = torch.zeros(B * 2, 64)
    labels[0, 3] = labels[2, 40] = 1
    cand = concept_candidates(labels, 5, torch.Generator().manual_seed(0))
    assert {3, 40} <= set(cand.tolist()) and len(cand) == 7
    batch = {"input_ids": torch.randint(5, 1000, (B, T)),
             "chunk_ids": torch.arange(B * 2).view(B, 2).repeat_interleave(32, 1), "chunk_labels": labels}
    tc = TrainConfig(steps=1, concept_negatives=5, eps_dropout=0.0)
    out = compute_losses(model, batch, tc, generator=torch.Generator().manual_seed(0))
    out["loss"].backward()
    g = model.concept.known_head.weight.grad.abs().sum(1)
    learned = set(g.nonzero().squeeze(1).tolist())
    assert {3, 40} <= learned and len(learned) == 7  # the positives + 5 sampled negatives only

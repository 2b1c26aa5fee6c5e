import torch

from model.config import ModelConfig, TrainConfig
from model.io import load_pretrained
from model.loop import make_optimizer, train, train_step
from model.modeling import Steerling


def test_training_lowers_lm_and_concept_loss(corpus_path, tmp_path):
    mc = ModelConfig.preset("tiny", family="cdlm_concept")
    tc = TrainConfig(steps=60, batch_size=8, seq_len=128, chunk_len=32, lr=3e-3, warmup_steps=5,
                     eval_every=30, eval_batches=4, seed=0)
    res = train(mc, tc, corpus_path, out_dir=tmp_path, progress=False)
    first, final = res.history[0], res.final
    assert first["step"] == 0 and res.history[-1]["step"] == 60
    assert final["val_loss"] < first["val_loss"] - 0.5
    assert final["concept_loss"] < 0.5 * first["concept_loss"]
    for key in ("val_loss", "train_loss", "tokens_seen", "params", "flops", "wall_s", "concept_loss",
                "concept_independence_loss", "concept_contribution", "concept_auc"):
        assert key in final, key
    assert final["tokens_seen"] == 60 * 8 * 128
    assert 0 <= final["concept_contribution"] <= 1
    # checkpoint is loadable (safetensors) and reproduces the trained model
    model, tok, names = load_pretrained(res.checkpoint)
    x = torch.randint(5, 1000, (1, 64))
    with torch.no_grad():
        assert torch.equal(model.eval()(x), res.model.eval()(x))
    assert tok.get_vocab_size() <= mc.vocab_size and len(names) == mc.n_known
    assert any(n for n in names)  # stand-in labeller produced a concept library


def test_ar_family_trains_from_documents_with_token_budget(small_docs):
    mc = ModelConfig.preset("tiny", family="ar", vocab_size=512)
    tc = TrainConfig(total_tokens=20 * 4 * 64, batch_size=4, seq_len=64, warmup_steps=2, eval_batches=2)
    res = train(mc, tc, small_docs, progress=False)
    assert res.final["steps"] == 20 and res.checkpoint is None
    assert res.final["val_loss"] < res.history[0]["val_loss"]
    assert "concept_loss" not in res.final


def test_train_step_is_reusable_with_an_external_optimizer():
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm_concept"))
    tc = TrainConfig(steps=5, dtype="fp32", warmup_steps=0)
    opt = make_optimizer(model, tc)
    B, T = 4, 64
    batch = {"input_ids": torch.randint(5, 1000, (B, T)),
             "chunk_ids": torch.arange(B * 2).view(B, 2).repeat_interleave(32, 1),
             "chunk_labels": (torch.rand(B * 2, 32) < 0.2).float()}
    before = model.concept.known_emb.detach().clone()
    logs = [train_step(model, opt, batch, tc, s, 5, torch.Generator().manual_seed(s)) for s in range(5)]
    assert all(set(("loss", "lm_loss", "concept_loss", "rec_loss", "lr")) <= set(l) for l in logs)
    assert logs[-1]["concept_loss"] < logs[0]["concept_loss"]
    assert not torch.equal(before, model.concept.known_emb)

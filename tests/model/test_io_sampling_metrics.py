import math

import pytest
import torch

from model.config import MASK_ID, SPECIAL_TOKENS, ModelConfig
from model.io import load_pretrained, save_pretrained
from model.labels import StandInLabeller
import numpy as np

from model.metrics import auc, calibrate, concept_detection_auc, concept_rank_alignment, known_concept_alignment
from model.modeling import Steerling
from model.sampling import commit_schedule, generate


def test_tokenizer_specials_and_round_trip(tokenizer):
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(name) == i
    text = "The lobster is a species of crustacean."
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    enc = tokenizer.encode("a [MASK] b").ids
    assert MASK_ID in enc  # [MASK] is one vocabulary entry, seen in training


@pytest.mark.parametrize("family", ["ar_concept", "cdlm_concept", "cdlm"])
def test_save_load_identical_logits(tmp_path, tokenizer, family):
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family=family, vocab_size=512)).eval()
    names = [f"c{i}" for i in range(model.cfg.n_known)] if model.cfg.has_concepts else None
    save_pretrained(model, tmp_path, tokenizer, names)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert not any(f.endswith((".pt", ".bin", ".pkl")) for f in files)
    loaded, tok, loaded_names = load_pretrained(tmp_path)
    assert loaded.cfg == model.cfg and loaded_names == names
    assert tok.get_vocab() == tokenizer.get_vocab()
    x = torch.randint(5, 500, (2, 64))
    with torch.no_grad():
        assert torch.equal(model(x), loaded.eval()(x))


def test_diffusion_generation_fills_blocks(tokenizer):
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm_concept", vocab_size=512))
    prompt = torch.tensor(tokenizer.encode("The lobster is").ids)
    out = generate(model, prompt, max_new_tokens=40, steps_per_block=4)
    assert out.shape == (1, len(prompt) + 40)
    assert torch.equal(out[0, : len(prompt)], prompt)
    assert not (out == MASK_ID).any() and not (out == 0).any()
    again = generate(model, prompt, max_new_tokens=40, steps_per_block=4)
    assert torch.equal(out, again)  # greedy is deterministic
    sampled = generate(model, prompt, 40, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert not (sampled == MASK_ID).any()
    assert commit_schedule(10, 4) == [3, 3, 2, 2] and sum(commit_schedule(16, 16)) == 16


@pytest.mark.parametrize("family", ["cdlm_concept", "ar"])
def test_forbidden_tokens_are_never_generated(family):
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family=family, vocab_size=512))
    prompt = torch.tensor([5, 6, 7])
    free = generate(model, prompt, max_new_tokens=32, steps_per_block=4)[0, 3:]
    banned = sorted(set(free.tolist()))[:3]  # tokens greedy decoding did emit
    out = generate(model, prompt, max_new_tokens=32, steps_per_block=4, forbid=banned)[0, 3:]
    assert not torch.isin(out, torch.tensor(banned)).any()
    assert not (out == MASK_ID).any()


def test_diffusion_commits_most_confident_first():
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm", vocab_size=512))
    B = model.cfg.block_size
    x = torch.randint(5, 500, (1, B))
    # one step per token: after a single step exactly one position is committed
    out = generate(model, x[:, :0].reshape(1, 0), max_new_tokens=B, steps_per_block=B)
    assert not (out == MASK_ID).any()
    from model.sampling import _forbid_specials
    probe = torch.full((1, B), MASK_ID)
    with torch.no_grad():
        conf = _forbid_specials(model(probe).float(), model.cfg).softmax(-1).amax(-1)[0]
    first = int(conf.argmax())
    assert out[0, first] == _forbid_specials(model(probe).float(), model.cfg)[0, first].argmax()


def test_ar_generation():
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="ar", vocab_size=512))
    out = generate(model, torch.tensor([5, 6, 7]), max_new_tokens=5)
    assert out.shape == (1, 8)
    with torch.no_grad():
        nxt = model(out[:, :3])[0, -1]
    nxt[[0, MASK_ID]] = -float("inf")
    assert out[0, 3] == nxt.argmax()


def test_auc():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([1, 2, 3], [0, 1, 1]) == 1.0 and auc([3, 2, 1], [0, 1, 1]) == 0.0
    assert auc([1, 1, 1, 1], [0, 1, 0, 1]) == 0.5
    assert math.isnan(auc([1, 2], [1, 1]))
    r = concept_detection_auc(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.1, 0.3]]), torch.tensor([[1, 0], [0, 1], [0, 0]]))
    assert r["micro"] == 1.0 and r["macro"] == 1.0


def test_micro_auc_has_a_base_rate_control():
    # One common concept (9 of 10 chunks) and one rare one (1 of 10): a "model" that only knows
    # how common each concept is wins micro AUC and nothing per concept.
    g = torch.Generator().manual_seed(0)
    y = torch.zeros(10, 2)
    y[:9, 0] = 1
    y[3, 1] = 1
    prevalence = torch.tensor([[0.9, 0.1]]).expand(10, 2)
    r = concept_detection_auc(prevalence, y)
    assert r["micro"] > 0.85 and r["micro"] == r["micro_base_rate"]
    assert r["macro"] == 0.5
    # a model that ranks the chunks within each concept right beats the control on micro too
    good = y * 0.5 + 0.25 + 0.01 * torch.rand(10, 2, generator=g)
    rg = concept_detection_auc(good, y)
    assert rg["macro"] == 1.0 and rg["micro"] > r["micro_base_rate"] and rg["micro_base_rate"] == r["micro_base_rate"]


def test_rank_alignment_is_calibrated_and_judged_alignment_needs_a_judge(tokenizer):
    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="cdlm_concept", vocab_size=512, n_known=4, topk_known=2))
    names = ["the", "of", "and", "in"]
    with pytest.raises(ValueError, match="judge"):
        known_concept_alignment(model, tokenizer, names, judge=None)
    # chance: a random direction's rank quantile averages q_chance; calibrated ~0 over many
    rand = [concept_rank_alignment(Steerling(ModelConfig.preset("tiny", family="cdlm_concept", vocab_size=512,
                                                                  n_known=4, topk_known=2)), tokenizer, names)
            for _ in range(15)]
    assert abs(np.mean([r["rank_alignment"] for r in rand])) < 0.2
    assert 0.5 <= rand[0]["quantile_chance"] < 1
    with torch.no_grad():  # point each K_i at its name's token: alignment should be perfect
        for i, n in enumerate(names):
            model.concept.known_emb[i] = model.lm_weight[tokenizer.encode(" " + n).ids[0]] * 10
    good = concept_rank_alignment(model, tokenizer, names)
    assert good["rank_alignment"] == pytest.approx(1.0) and good["hit_at_k"] == 1.0
    assert good["hit_at_k_chance"] < 0.2
    judged = known_concept_alignment(model, tokenizer, names,
                                     judge=lambda name, top: 5.0 if name in "".join(top) else 1.0)
    assert judged["known_concept_alignment"] == 5.0
    assert len(judged["top_tokens"]["the"]) == 20
    assert calibrate(0.75, 0.5) == pytest.approx(0.5)


def test_stand_in_labeller():
    secs = [("History", "the river city grew along the river"), ("History", "city walls and river trade"),
            ("History", "another city"), ("Plot", "the hero fights a dragon in the city")] * 3
    lab = StandInLabeller.fit(secs, 5, section_share=0.4, min_count=2, max_df=1.0)
    assert "section:history" in lab.names and "kw:city" in lab.names
    ids = lab.label("A small CITY by the sea", "History")
    assert lab.names.index("kw:city") in ids and lab.names.index("section:history") in ids
    assert lab.label("nothing relevant here", None) == []

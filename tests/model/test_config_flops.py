import json

import pytest
from pydantic import ValidationError

from model.config import PRESETS, ModelConfig, TrainConfig
from model.flops import attended_keys, count_params, train_flops, train_flops_per_token
from model.modeling import Steerling

FAMILIES = ["ar", "ar_concept", "cdlm", "cdlm_concept"]


def test_unknown_key_is_an_error_naming_the_key():
    with pytest.raises(ValidationError, match="n_layerz"):
        ModelConfig(n_layerz=3)
    with pytest.raises(ValidationError, match="learning_rate"):
        TrainConfig(steps=1, learning_rate=1e-3)


def test_invalid_shapes_rejected():
    with pytest.raises(ValidationError, match="divisible"):
        ModelConfig(d_model=64, n_heads=5)
    with pytest.raises(ValidationError, match="topk_known"):
        ModelConfig.preset("tiny", family="cdlm_concept", topk_known=1000)
    with pytest.raises(ValidationError, match="block_size"):
        ModelConfig.preset("tiny", family="cdlm", block_size=24)
    with pytest.raises(ValidationError, match="exactly one"):
        TrainConfig(steps=3, total_tokens=100)


def test_presets_and_json_round_trip(tmp_path):
    for name in PRESETS:
        for fam in FAMILIES:
            cfg = ModelConfig.preset(name, family=fam)
            assert cfg.has_concepts == fam.endswith("concept")
            assert cfg.is_diffusion == fam.startswith("cdlm")
            again = ModelConfig.model_validate_json(cfg.model_dump_json())
            assert again == cfg
    cfg = ModelConfig.preset("8B")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.block_size) == (32, 4096, 32, 4, 64)
    assert (cfg.n_known, cfg.n_unknown, cfg.topk_known, cfg.topk_unknown, cfg.unknown_rank) == (33732, 101196, 32, 128, 256)
    assert (ModelConfig.preset("10M").n_layers, ModelConfig.preset("10M").d_model) == (6, 320)
    assert (ModelConfig.preset("5B").n_layers, ModelConfig.preset("5B").d_model) == (24, 3840)
    cfg.to_json(tmp_path / "c.json")
    assert ModelConfig.from_json(tmp_path / "c.json") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["family"] == "cdlm_concept"
    assert ModelConfig.preset("tiny", family="cdlm").n_known == 0
    default = ModelConfig()  # defaults form a valid (tiny) model
    assert ModelConfig(**default.model_dump()) == default and default.has_concepts


@pytest.mark.parametrize("family", FAMILIES)
def test_param_count_matches_the_built_model(family):
    cfg = ModelConfig.preset("tiny", family=family)
    p = count_params(cfg)
    model = Steerling(cfg)
    assert p["total"] == sum(t.numel() for t in model.parameters())
    assert p["embedding"] == model.tok_emb.weight.numel()
    concept = sum(t.numel() for t in model.concept.parameters()) if model.concept is not None else 0
    assert p["concept"] == concept
    assert p["non_embedding"] == p["backbone"] + p["concept_heads"]


def test_train_flops():
    ar = ModelConfig.preset("tiny", family="ar")
    cd = ModelConfig.preset("tiny", family="cdlm")
    T = 128
    n = count_params(ar)["non_embedding"]
    attn = 12 * ar.n_layers * ar.d_model * (T + 1) / 2
    assert train_flops_per_token(ar, T) == pytest.approx(6 * n + attn)
    # block-causal attends (T + B) / 2 keys on average: a bit more than causal
    assert attended_keys(cd, T) == pytest.approx((T + cd.block_size) / 2)
    assert train_flops_per_token(cd, T) > train_flops_per_token(ar, T)
    assert train_flops(ar, 1000, T) == pytest.approx(1000 * train_flops_per_token(ar, T))
    with_head = train_flops_per_token(ar, T, include_lm_head=True)
    assert with_head - train_flops_per_token(ar, T) == pytest.approx(6 * ar.vocab_size * ar.d_model)


def test_teacher_forcing_schedule():
    tc = TrainConfig(steps=100, tf_start=1.0, tf_final=0.0, tf_hold_frac=0.2, tf_end_frac=0.6)
    assert tc.teacher_forcing(0) == 1.0 and tc.teacher_forcing(20) == 1.0
    assert tc.teacher_forcing(40) == pytest.approx(0.5)
    assert tc.teacher_forcing(60) == 0.0 and tc.teacher_forcing(99) == 0.0
    assert TrainConfig(total_tokens=10_000, batch_size=4, seq_len=64).total_steps == 40


def test_paper_presets_reproduce_table_24_counts():
    # (backbone params, +Concept total) in millions, paper Table 24
    table = {"10M": (9.2, 82.8), "25M": (23.6, 110.2), "85M": (86.5, 190.5), "200M": (197.7, 319.1),
             "400M": (401.1, 540.0), "800M": (779.9, 953.6), "1.5B": (1510, 1718), "3B": (3228, 3489),
             "5B": (5694, 6007)}
    for name, (backbone, with_concepts) in table.items():
        p = count_params(ModelConfig.preset(name))
        assert p["backbone"] / 1e6 == pytest.approx(backbone, rel=0.015), name
        assert (p["backbone"] + p["concept"]) / 1e6 == pytest.approx(with_concepts, rel=0.015), name
    p8 = count_params(ModelConfig.preset("8B"))
    assert p8["concept"] / p8["total"] == pytest.approx(0.04, abs=0.005)  # "~4% of parameters"

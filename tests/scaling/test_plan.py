import pytest

from model.scaling.plan import SweepPlan, plan_isoflop


@pytest.mark.parametrize("mode", ["model", "6N"])
def test_grid_hits_each_budget(mode):
    from model.config import ModelConfig
    from model.flops import count_params, train_flops

    budgets = [1e10, 3e10, 1e11]
    plan = plan_isoflop(budgets, ["cdlm_concept", "ar"], n_sizes=3, flops_mode=mode)
    assert len(plan.runs) == 2 * 3 * 3
    for r in plan.runs:
        cfg = ModelConfig.model_validate(r.model_config)
        assert cfg.family == r.family
        assert count_params(cfg)["non_embedding"] == r.params
        T = r.train_config["seq_len"]
        assert r.tokens % (r.train_config["batch_size"] * T) == 0  # whole steps
        real = train_flops(cfg, r.tokens, T) if mode == "model" else 6 * r.params * r.tokens
        assert real == pytest.approx(r.flops, rel=1e-9)
        assert real == pytest.approx(r.budget, rel=0.03)  # realised C within 3% of budget
        ratio = 6 * r.params * r.tokens / r.budget  # 6ND <= C (attention etc. on top)
        assert (0.5 < ratio <= 1.03) if mode == "model" else ratio == pytest.approx(1, rel=0.03)
    for fam in ("cdlm_concept", "ar"):
        for b in budgets:
            rs = sorted((r for r in plan.runs if r.family == fam and r.budget == b),
                        key=lambda r: r.size_index)
            ps = [r.params for r in rs]
            assert ps == sorted(ps) and len(set(ps)) == 3  # distinct, increasing sizes
            toks = [r.tokens for r in rs]
            assert toks == sorted(toks, reverse=True)  # bigger model, fewer tokens


def test_sizes_grow_with_budget_and_plan_roundtrips(tmp_path):
    plan = plan_isoflop([1e10, 1e12], ["ar"], n_sizes=3)
    mid = {r.budget: r.params for r in plan.runs if r.size_index == 1}
    assert mid[1e12] > 3 * mid[1e10]
    p = plan.write(tmp_path / "plan.json")
    back = SweepPlan.read(p)
    assert [r.run_id for r in back.runs] == [r.run_id for r in plan.runs]
    m, t = back.runs[0].configs()
    assert t.total_tokens == back.runs[0].tokens
    plan.write(tmp_path / "plan.csv")
    assert (tmp_path / "plan.csv").read_text().count("\n") == len(plan.runs) + 1


def test_unreachable_budget_is_reported():
    with pytest.raises(ValueError, match="budget not reachable"):
        plan_isoflop([1e6], ["ar"], n_sizes=3)  # a few optimiser steps already exceed it
    with pytest.raises(ValueError):
        plan_isoflop([-1.0], ["ar"])

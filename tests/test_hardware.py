"""The compute dtype follows the hardware: bf16 only where it is native (emulated bf16 is
~100x slower than fp32 on an AVX2-only CPU); explicit choices are kept."""

import pytest

from atlas import hardware
from atlas.config import EngineConfig
from atlas.engine import engine_dtype
from model.loop import autocast_factory, resolve_dtype


@pytest.fixture
def flags(monkeypatch):
    def set_flags(*names):
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(names))

    return set_flags


def test_cpu_flags_read_from_this_host():
    f = hardware.cpu_flags()
    assert hardware.cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & f)


@pytest.mark.parametrize("cpu, want", [(("avx2", "fma"), "float32"), (("avx2", "avx512f", "avx512_bf16"), "bfloat16"),
                                       (("amx_bf16",), "bfloat16")])
def test_engine_dtype_follows_cpu(flags, cpu, want):
    flags(*cpu)
    assert engine_dtype(EngineConfig()) == want
    assert engine_dtype(EngineConfig(dtype="bfloat16")) == "bfloat16"  # an explicit choice is kept
    assert engine_dtype(EngineConfig(device="gpu")) == "bfloat16"


def test_engine_cache_key_names_the_resolved_dtype(flags):
    from atlas.engine import Engine

    flags("avx2")
    a = Engine(EngineConfig(backend="test"), model="m").model_id
    flags("avx512_bf16")
    b = Engine(EngineConfig(backend="test"), model="m").model_id
    assert a.endswith("|float32") and b.endswith("|bfloat16")  # no cache reuse across numerics


def test_train_dtype_auto(flags):
    import torch

    flags("avx2")
    assert resolve_dtype("auto", "cpu") == "fp32" and resolve_dtype("bf16", "cpu") == "bf16"
    with autocast_factory("auto", "cpu")():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    flags("amx_bf16")
    with autocast_factory("auto", "cpu")():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16

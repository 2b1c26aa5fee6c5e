"""What the host's hardware does fast. Only the standard library at import time: model/,
the engine and the benchmarks all ask it before choosing a dtype.

Why it matters: bf16 is the fast path only where the hardware has it. On a CPU with
AVX512-BF16 or AMX a bf16 matmul runs several times faster than fp32, but on an AVX2-only
CPU torch emulates bf16 and the same matmul is about 100x *slower* (measured here:
0.8 vs 114 GFLOP/s at 1024^2, 2 threads), and vLLM's CPU backend tags a chunk 4x slower.
"""

from __future__ import annotations

import functools
from pathlib import Path

# /proc/cpuinfo flags of x86 CPUs that compute bf16 natively.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags (empty where /proc/cpuinfo does not exist, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    return any(f in cpu_flags() for f in _BF16_FLAGS)


def native_bf16(device_type: str) -> bool:
    """True where bf16 compute is native on ``device_type`` ("cpu" or "cuda"/"gpu")."""
    if device_type in ("cuda", "gpu"):
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return cpu_has_native_bf16()

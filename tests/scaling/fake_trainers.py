"""Stand-in training entrypoints for the runner's failure handling (same signature as
model.loop.train). ``corpus`` carries a marker directory so a run can fail once."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace


def _final(mcfg, tcfg):
    from model.flops import count_params, train_flops

    n = count_params(mcfg)["non_embedding"]
    tokens = tcfg.total_steps * tcfg.tokens_per_step
    loss = 2.0 + 30.0 / n ** 0.3 + 50.0 / tokens ** 0.3
    return {"val_loss": loss, "train_loss": loss + 0.1, "tokens_seen": tokens, "params": n,
            "flops": train_flops(mcfg, tokens, tcfg.seq_len), "wall_s": 0.01,
            "concept_loss": 0.1 + 1.0 / math.log(n)}


def always_fail(mcfg, tcfg, corpus, out_dir=None, progress=False):
    raise RuntimeError(f"boom d_model={mcfg.d_model}")


def flaky(mcfg, tcfg, corpus, out_dir=None, progress=False):
    """Fails the first attempt of each shape (marker files under ``corpus``), then succeeds."""
    marker = Path(corpus) / f"seen-{mcfg.n_layers}-{mcfg.d_model}-{tcfg.total_tokens}"
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        raise RuntimeError("transient failure")
    return SimpleNamespace(final=_final(mcfg, tcfg))

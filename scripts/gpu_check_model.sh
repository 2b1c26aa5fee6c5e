#!/usr/bin/env bash
# Short GPU correctness check for the Steerling model (run on a machine with CUDA):
# flex-attention (compiled, block-sparse) vs SDPA forward and backward, CUDA generators in
# the losses / evaluation / sampling, the exact logit decomposition, and a few bf16 training
# steps. Exits non-zero on the first mismatch. ~1-2 minutes (most of it torch.compile).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" - <<'PYEOF'
import time
import torch

from model.config import ModelConfig, TrainConfig
from model.loop import autocast_factory, make_optimizer, train_step
from model.metrics import evaluate
from model.modeling import Steerling
from model.objectives import compute_losses
from model.sampling import generate

assert torch.cuda.is_available(), "no CUDA device"
dev = torch.device("cuda")
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
t0 = time.time()

# 1. flex (compiled) == sdpa, forward and backward, fp32
cfg = ModelConfig.preset("tiny", family="cdlm_concept", attn_backend="sdpa", max_seq_len=256, block_size=64)
torch.manual_seed(0)
a = Steerling(cfg).to(dev)
b = Steerling(cfg.model_copy(update={"attn_backend": "flex"})).to(dev)
b.load_state_dict(a.state_dict())
x = torch.randint(5, 1000, (2, 256), device=dev)
la, lb = a(x), b(x)
err = (la - lb).abs().max().item()
assert err < 1e-3, f"flex vs sdpa forward max error {err}"
la.float().pow(2).mean().backward(); lb.float().pow(2).mean().backward()
for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
    if pa.grad is None:
        continue
    gerr = (pa.grad - pb.grad).abs().max().item() / (pa.grad.abs().max().item() + 1e-12)
    assert gerr < 1e-2, f"flex vs sdpa grad {n}: rel error {gerr}"
print(f"[ok] flex == sdpa (fwd max err {err:.2e}, grads rel < 1e-2)", flush=True)

# 2. block-causal structure holds under flex on GPU
with torch.no_grad():
    y = x.clone(); y[0, 130] = (y[0, 130] + 7) % 1000
    d = (b(x) - b(y)).abs().amax(-1)[0]
assert d[:128].max() == 0 and d[128:131].min() > 0, "block-causal mask broken under flex"
print("[ok] block-causal mask under flex", flush=True)

# 3. losses, evaluation and sampling with CUDA generators (a CPU generator would raise)
B, T = 4, 256
batch = {"input_ids": torch.randint(5, 1000, (B, T), device=dev),
         "chunk_ids": torch.arange(B * 4, device=dev).view(B, 4).repeat_interleave(64, 1),
         "chunk_labels": (torch.rand(B * 4, cfg.n_known, device=dev) < 0.1).float()}
tc = TrainConfig(steps=20, batch_size=B, seq_len=T, chunk_len=64, warmup_steps=2, dtype="bf16", concept_negatives=8)
g = torch.Generator(device=dev).manual_seed(0)
b.train()
out = compute_losses(b, batch, tc, generator=g)
out["loss"].backward()
assert torch.isfinite(out["loss"]), out
opt = make_optimizer(b, tc)
logs = [train_step(b, opt, batch, tc, s, 20, g, autocast_factory("bf16", "cuda")) for s in range(20)]
assert logs[-1]["loss"] < logs[0]["loss"], (logs[0], logs[-1])
res = evaluate(b, [batch], tc, autocast=autocast_factory("bf16", "cuda"))
for k in ("val_loss", "concept_auc", "concept_contribution", "concept_loss", "concept_independence_loss"):
    assert k in res and res[k] == res[k], (k, res)
print("[ok] losses / 20 bf16 train steps / evaluate on CUDA:", {k: round(v, 4) for k, v in res.items()}, flush=True)
gen = generate(b, batch["input_ids"][:1, :64], 64, steps_per_block=8, temperature=1.0,
               generator=torch.Generator(device=dev).manual_seed(1))
assert gen.shape == (1, 128) and not (gen == cfg.mask_token_id).any()
print("[ok] diffusion sampling with a CUDA generator", flush=True)

# 4. exact decomposition on GPU (fp32)
b.eval()
dec = b.decompose(batch["input_ids"][:1])
print(f"[ok] decomposition max abs error {dec.max_abs_error:.2e}", flush=True)
print(f"GPU check passed in {time.time() - t0:.0f}s")
PYEOF

#!/usr/bin/env bash
# A few-minute check of Atlas's GPU path, for a machine with an NVIDIA GPU:
#   env         torch sees CUDA (name, capability, versions)
#   nccl        torch.distributed NCCL all-reduce / broadcast, world size 1 (communicator set-up + kernels)
#   faiss_kmeans  faiss-gpu k-means on clustered data: recovers the clusters, objective ~ CPU's
#   gemma       the packaged Gemma 3 270M prepared (GGUF -> bf16 HF directory, on this node)
#   vllm_gpu    our vLLM backend on the GPU: JSON-schema-constrained generation on the prepared Gemma
#   pipeline    `atlas run` (ingest -> chunk -> tag -> judge) on demo docs with engine.device=gpu,
#               engine actors scheduled by Ray with num_gpus=1
# Prints one PASS/FAIL line per check (details in $GPU_CHECK_OUT/<check>.log), then a summary;
# exits non-zero if any check failed. Needs the GPU install (ATLAS_EXTRA=gpu bash scripts/setup.sh:
# vllm, faiss-gpu, CUDA torch); offline (HF_HUB_OFFLINE=1). Skip the pipeline run with --quick.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in "${ATLAS_VENV:-}/bin/python" "$HOME/.cache/atlas/venv/bin/python" "$(command -v python3)"; do
    [ -x "$cand" ] && { PY=$cand; break; }
  done
fi
QUICK=0; [ "${1:-}" = "--quick" ] && QUICK=1
OUT=${GPU_CHECK_OUT:-$(mktemp -d -t atlas-gpu-check-XXXX)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export ATLAS_RAY_TMP=${ATLAS_RAY_TMP:-$OUT}
unset RAY_ADDRESS  # the pipeline check starts its own local Ray cluster
echo "gpu_check: python=$PY out=$OUT load=$(cut -d' ' -f1-3 /proc/loadavg)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

pass=0; fail=0
# check NAME SECONDS CMD...: run CMD under a time limit; PASS shows the log's last line (a summary
# each check prints), FAIL the exit status and the log's tail.
check() {
  local name=$1 limit=$2; shift 2
  local log="$OUT/$name.log" t0=$SECONDS rc
  timeout --kill-after=20 "$limit" "$@" >"$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    pass=$((pass + 1)); echo "PASS $name ($((SECONDS - t0))s): $(tail -n 1 "$log")"
  else
    fail=$((fail + 1))
    local why="rc=$rc"; [ $rc -eq 124 ] && why="timed out after ${limit}s"
    echo "FAIL $name ($why): $(tail -n 4 "$log" | tr '\n' ' ' | cut -c1-500)"
  fi
}
pyfile() { cat >"$OUT/$1.py"; echo "$OUT/$1.py"; }

ENV_PY=$(pyfile env <<'EOF'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device (CPU build? driver?)"
p = torch.cuda.get_device_properties(0)
x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
y = (x @ x).float().sum().item()  # a real kernel, not only device discovery
assert y == y, "matmul produced NaN"
print(f"{torch.cuda.device_count()} x {p.name} cc{p.major}.{p.minor} {p.total_memory / 2**30:.0f} GiB, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
)

NCCL_PY=$(pyfile nccl <<'EOF'
import socket, time
import torch
import torch.distributed as dist

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.arange(16, device="cuda", dtype=torch.float32)
dist.all_reduce(t, op=dist.ReduceOp.SUM)
assert torch.equal(t.cpu(), torch.arange(16, dtype=torch.float32)), t
b = torch.full((4,), 7.0, device="cuda")
dist.broadcast(b, src=0)
big = torch.ones(64 * 2**20 // 4, device="cuda")  # 64 MiB
dist.all_reduce(big); torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    dist.all_reduce(big)
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / 10
assert big[0].item() == 1.0 and b.sum().item() == 28.0
dist.barrier()
dist.destroy_process_group()
v = torch.cuda.nccl.version()
print(f"NCCL {'.'.join(map(str, v)) if isinstance(v, tuple) else v}: all_reduce/broadcast/barrier ok, "
      f"64 MiB all_reduce {dt * 1e3:.2f} ms (world size 1)")
EOF
)

FAISS_PY=$(pyfile faiss_kmeans <<'EOF'
import time
import numpy as np
import faiss

assert faiss.get_num_gpus() >= 1, f"faiss {faiss.__version__} sees no GPU (faiss-cpu installed instead of faiss-gpu?)"
rng = np.random.default_rng(0)
d, k, n = 64, 64, 200_000
centers = rng.normal(0, 10, (k, d)).astype("float32")
truth = rng.integers(0, k, n)
x = (centers[truth] + rng.normal(0, 1, (n, d))).astype("float32")

# Same start for both (one point of each true cluster): then GPU and CPU must reach the same,
# correct clustering, so a wrong GPU kernel shows as low purity or a different objective.
init = x[[int(np.flatnonzero(truth == c)[0]) for c in range(k)]]

def run(gpu):
    km = faiss.Kmeans(d, k, niter=25, seed=1, gpu=gpu, verbose=False)
    t0 = time.perf_counter(); km.train(x, init_centroids=init); dt = time.perf_counter() - t0
    _, assign = km.index.search(x, 1)
    return km.obj[-1], assign[:, 0], dt, km

obj_g, a_g, dt_g, _ = run(True)
obj_c, _, dt_c, _ = run(False)
# purity: share of points whose cluster's majority true label is their own
purity = sum(np.bincount(truth[a_g == c]).max() for c in np.unique(a_g)) / n
assert purity >= 0.95, f"GPU k-means purity {purity:.3f} < 0.95"
assert abs(obj_g / obj_c - 1) < 0.01, f"GPU objective {obj_g:.6g} differs from CPU {obj_c:.6g} by > 1%"
print(f"faiss {faiss.__version__}: {n}x{d}, k={k}: purity {purity:.3f}, objective GPU/CPU {obj_g / obj_c:.3f}, "
      f"GPU {dt_g:.2f}s vs CPU {dt_c:.2f}s ({dt_c / max(dt_g, 1e-9):.1f}x)")
EOF
)

VLLM_PY=$(pyfile vllm_gpu <<'EOF'
import json, time
from atlas.config import EngineConfig
from atlas.engine import Sampling, make_backend, resolve_model

model_dir = resolve_model("embedded:gemma3-270m")
cfg = EngineConfig(device="gpu", backend="vllm", gpu_memory_utilization=0.3, max_model_len=2048, enforce_eager=True)
t0 = time.perf_counter()
backend = make_backend(model_dir, cfg)
load = time.perf_counter() - t0
from vllm.platforms import current_platform
assert current_platform.device_type == "cuda", f"vLLM platform is {current_platform.device_type!r}, not cuda"
topics = ["the French Revolution", "photosynthesis in plants", "the history of jazz", "plate tectonics",
          "the Apollo 11 mission", "medieval castles", "coral reef ecology", "the printing press"]
prompts = [f"Text: An encyclopedia article about {t}.\nTopic tags as a JSON list of short lowercase phrases:" for t in topics] * 8
schema = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 5}
t0 = time.perf_counter()
results = backend.generate(prompts, Sampling(max_tokens=48, temperature=0.0, json_schema=schema))
gen = time.perf_counter() - t0
ok = 0
for r in results:
    assert r.error is None, r.error
    tags = json.loads(r.text)
    ok += isinstance(tags, list) and all(isinstance(t, str) for t in tags)
assert ok == len(prompts), f"only {ok}/{len(prompts)} answers match the JSON schema"
toks = sum(r.output_tokens or 0 for r in results)
backend.close()
print(f"vLLM on {current_platform.device_name if hasattr(current_platform, 'device_name') else 'cuda'}: "
      f"load {load:.1f}s, {len(prompts)} prompts in {gen:.2f}s ({toks / gen:.0f} output tok/s), "
      f"all schema-valid; e.g. {results[0].text.strip()[:60]}")
EOF
)

PIPE_PY=$(pyfile pipeline_verify <<'EOF'
import json, sys
from atlas import storage
out = sys.argv[1]
root = storage.resolve(out)
m = json.loads(storage.read_bytes(root.join("_manifest.json")))
assert m["status"] == "done", m["status"]
tags = storage.read_table(root, "chunk_tags").to_pylist()
errors = [r for r in tags if r.get("error")]
assert tags and len(errors) <= 0.1 * len(tags), f"{len(errors)}/{len(tags)} tagging errors, e.g. {errors[:1]}"
judged = storage.read_table(root, "tag_judgements").num_rows
print(f"pipeline on GPU: {len(tags)} chunks tagged ({len(errors)} errors), {judged} judgements; stages: "
      + ", ".join(f"{k}={v.get('seconds')}s" for k, v in m["stages"].items()))
EOF
)

check env 120 "$PY" "$ENV_PY"
check nccl 180 "$PY" "$NCCL_PY"
check faiss_kmeans 300 "$PY" "$FAISS_PY"
check gemma 600 "$PY" -m atlas.cli prepare-model gemma3-270m
check vllm_gpu 600 "$PY" "$VLLM_PY"
if [ $QUICK -eq 0 ]; then
  corpus="$OUT/corpus"; mkdir -p "$corpus"
  ls atlas/demo/corpus/*.txt | head -n 3 | xargs -I{} cp {} "$corpus/"
  check pipeline 900 bash -c "\"$PY\" -m atlas.cli run --input \"$corpus\" --output \"$OUT/run\" --run-id gpu-check \
    --set engine.device=gpu --set engine.gpu_memory_utilization=0.3 --set ray.num_cpus=8 \
    --set stage1.max_chunks=32 --set judge.sample_chunks=8 --log-file \"$OUT/run.jsonl\" \
    && \"$PY\" \"$PIPE_PY\" \"$OUT/run\""
fi
echo "gpu_check: $pass passed, $fail failed (logs: $OUT; load $(cut -d' ' -f1-3 /proc/loadavg))"
[ $fail -eq 0 ]

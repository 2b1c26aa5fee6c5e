"""Start-up of the vLLM CPU engine: ours against vLLM's full offline start, in the same run.

* ours: ``atlas.engine.VLLMBackend`` as the stages use it (``core._offline_llm_start`` skips
  the async renderer's tokenizer deep copies and the AutoProcessor chat-template probe);
* baseline: the same backend with that block replaced by a no-op, i.e. vLLM's own start.

Each start runs in a fresh Python process (as an engine actor does), alternating ours and
baseline, ``--reps`` times per model. Printed per start: seconds in ``LLM()`` (the backend's
``load_seconds``), seconds to a first answer from a new process (imports included), and
the greedy answers to two prompts, which must be identical between the variants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Lobsters are"]

_CHILD = r"""
import contextlib, json, sys, time
t0 = time.perf_counter()
from atlas.config import EngineConfig
from atlas.engine import Sampling, resolve_model
import atlas.engine.core as core
if sys.argv[2] == "baseline":
    core._offline_llm_start = lambda model_dir: contextlib.nullcontext()
cfg = EngineConfig(model=sys.argv[1], max_model_len=1024, max_num_seqs=16, kv_cache_gib=float(sys.argv[3]))
be = core.VLLMBackend(resolve_model(cfg.model), cfg)
answers = [r.text for r in be.generate(json.loads(sys.argv[4]), Sampling(max_tokens=8))]
print(json.dumps({"load_s": be.load_seconds, "to_first_answer_s": time.perf_counter() - t0, "answers": answers}))
be.close()
"""


def start(model: str, variant: str, kv_gib: float) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, model, variant, str(kv_gib), json.dumps(PROMPTS)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{variant} start of {model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="embedded:gemma3-270m,embedded:smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=0.5)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    for model in args.models.split(","):
        runs: dict[str, list[dict]] = {"ours": [], "baseline": []}
        for _ in range(args.reps):
            for variant in ("ours", "baseline"):
                r = start(model, variant, args.kv_gib)
                runs[variant].append(r)
                print(f"  {model} {variant:8s} LLM() {r['load_s']:6.2f} s  to first answer {r['to_first_answer_s']:6.2f} s", flush=True)
        med = {v: {k: statistics.median(r[k] for r in rs) for k in ("load_s", "to_first_answer_s")} for v, rs in runs.items()}
        same = all(r["answers"] == runs["baseline"][0]["answers"] for rs in runs.values() for r in rs)
        print(
            f"{model}: median LLM() ours {med['ours']['load_s']:.2f} s vs baseline {med['baseline']['load_s']:.2f} s "
            f"({med['baseline']['load_s'] / med['ours']['load_s']:.2f}x); to first answer {med['ours']['to_first_answer_s']:.2f} "
            f"vs {med['baseline']['to_first_answer_s']:.2f} s; identical answers: {same}"
        )
        if not same:
            raise SystemExit(f"answers differ: {json.dumps(runs, indent=1)}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""Concept steering benchmark (paper Table 10, AxBench protocol) on a small Steerling model.

Random known concepts x prompts, four conditions:
  unsteered   plain greedy generation
  prompting   the concept named in the context: "This text is about <concept>. " + prompt
  steered     concept direction injected (model/steering.py), strength/layer per concept
              chosen on a held-out prompt split (best mean harmonic score)
  random      a random direction with the steered delta's norm, same layer

Scores (0-2 each, as AxBench's ratings):
  concept  KEYWORD SCORER (not an LLM judge; Stage 3's annotator does not exist yet): the
           concepts are the stand-in labeller's keyword concepts (model/labels.py), whose
           rule is "the chunk contains the word"; score = 0 / 1 / 2 for 0 / 1 / >=2
           whole-word occurrences (plural "s" allowed) in the generated continuation.
  quality  fluency from the perplexity of the continuation given the prompt under a
           different model, the embedded Gemma 3 270M (transformers), mapped to 0-2 by two
           anchors measured in this run: 2 at the median perplexity of the corpus's own
           held-out continuations of the same prompts, 0 at the median perplexity of random
           token strings from the Steerling vocabulary (log-linear in between, clipped);
           times a repetition factor, min(1, distinct-word ratio / reference ratio), because
           perplexity alone rewards degenerate loops ("the the the ..." scores below the
           reference perplexity) where AxBench's fluency judge would not.
  harmonic 2 c q / (c + q), 0 if either is 0 (zero veto). AxBench also rates instruction
           relevance; our prompts are text openings, not instructions, so it is left out.

The model is trained here (a few minutes on the demo corpus) unless --model points at a
saved one. Prints load average: timings/scores are from a shared machine.
Usage: python benchmarks/steering.py [--model DIR] [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig, TrainConfig  # noqa: E402
from model.corpus import read_documents  # noqa: E402
from model.io import load_pretrained  # noqa: E402
from model.steering import make_steering, random_steering, steered_generate  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "atlas" / "demo" / "corpus"
GOALS = {"concept_vs_random": 2.0, "concept_vs_prompting": 1.0, "harmonic_vs_unsteered": 10.0,
         "quality_vs_unsteered": 0.85}


def log(msg: str) -> None:
    print(f"[steering {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", flush=True)


# ----------------------------------------------------------------------------- model
def train_model(out: Path, steps: int, corpus: Path, d_model: int = 128, n_layers: int = 4, seq_len: int = 128,
                lr: float = 3e-3) -> Path:
    from model.loop import train

    mc = ModelConfig.preset("tiny", family="cdlm_concept", vocab_size=2048, d_model=d_model, n_layers=n_layers,
                            n_heads=4, n_kv_heads=2, max_seq_len=128, block_size=16, n_known=48, n_unknown=144,
                            topk_known=4, topk_unknown=8)
    tc = TrainConfig(steps=steps, batch_size=8, seq_len=seq_len, chunk_len=min(64, seq_len), lr=lr, warmup_steps=20,
                     eval_every=max(1, steps // 4), eval_batches=2, seed=0, val_fraction=0.1)
    res = train(mc, tc, str(corpus), out_dir=out, progress=True, device="cpu")
    log(f"trained: val_loss {res.final['val_loss']:.3f}, known-concept alignment hit@20 "
        f"{res.final.get('concept_rank_hit_at_20')}")
    return Path(res.checkpoint)


# ----------------------------------------------------------------------------- scorers
def concept_score(text: str, concept: str) -> int:
    n = len(re.findall(rf"\b{re.escape(concept.lower())}s?\b", text.lower()))
    return 0 if n == 0 else (1 if n == 1 else 2)


class Fluency:
    """Perplexity under Gemma 3 270M mapped to 0-2 by anchors (see the module docstring)."""

    def __init__(self):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from atlas.engine import resolve_model

        path = resolve_model("embedded:gemma3-270m")
        self.tok = AutoTokenizer.from_pretrained(path)
        self.lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.lo = self.hi = None  # log-ppl anchors: lo -> 2, hi -> 0

    @torch.no_grad()
    def log_ppl(self, prompts: list[str], conts: list[str], batch: int = 16) -> list[float]:
        """Mean NLL per continuation token given the prompt (batched, right-padded)."""
        out: list[float] = []
        for lo in range(0, len(prompts), batch):
            seqs, spans = [], []
            for p, c in zip(prompts[lo:lo + batch], conts[lo:lo + batch]):
                pi = self.tok(p).input_ids  # BOS + prompt
                ci = self.tok(c, add_special_tokens=False).input_ids
                seqs.append(pi + ci)
                spans.append((len(pi), len(pi) + len(ci)))
            L = max(len(x) for x in seqs)
            pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
            ids = torch.tensor([x + [pad] * (L - len(x)) for x in seqs])
            att = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in seqs])
            logp = self.lm(input_ids=ids, attention_mask=att).logits.float().log_softmax(-1)
            for r, (a, b) in enumerate(spans):
                if b == a:
                    out.append(float("inf"))
                    continue
                tgt = ids[r, a:b]
                out.append(float(-logp[r, a - 1:b - 1].gather(1, tgt[:, None]).mean()))
        return out

    def calibrate(self, lo_samples: list[float], hi_samples: list[float]) -> None:
        self.lo, self.hi = statistics.median(lo_samples), statistics.median(hi_samples)
        if not self.hi > self.lo:
            raise RuntimeError(f"fluency anchors inverted: reference log-ppl {self.lo:.2f} >= random {self.hi:.2f}")

    def score(self, lp: float) -> float:
        if not math.isfinite(lp):
            return 0.0
        return 2.0 * min(1.0, max(0.0, (self.hi - lp) / (self.hi - self.lo)))


def distinct_ratio(text: str) -> float:
    words = text.lower().split()
    return len(set(words)) / len(words) if words else 0.0


def harmonic(c: float, q: float) -> float:
    return 0.0 if c <= 0 or q <= 0 else 2 * c * q / (c + q)


# ----------------------------------------------------------------------------- data
def make_prompts(docs: list[str], n: int, prompt_words: int, cont_words: int, rng: random.Random):
    """(prompt, reference continuation) pairs from held-out documents' sentences."""
    sents = []
    for d in docs:
        for line in d.splitlines():
            if line.strip().startswith("="):
                continue
            for s in re.split(r"(?<=\.)\s+", line.strip()):
                w = s.split()
                if len(w) >= prompt_words + cont_words and "<unk>" not in s and s[0].isupper():
                    sents.append(w)
    rng.shuffle(sents)
    return [(" ".join(w[:prompt_words]), " " + " ".join(w[prompt_words:prompt_words + cont_words])) for w in sents[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="saved Steerling checkpoint (default: train one here)")
    ap.add_argument("--out", default="benchmark-steering", help="output folder (model, results.json)")
    ap.add_argument("--corpus", default=str(DEMO))
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--concepts", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="half held out for strength selection, half for test")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--strengths", default="2,4,8,16", help="logit units tried on the held-out split")
    ap.add_argument("--layers", default="", help="injection layers tried (default: n_layers and n_layers//2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 concepts x 4 prompts, 2 strengths")
    args = ap.parse_args()
    if args.quick:
        args.concepts, args.prompts, args.strengths = 3, 4, "4,16"
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    log(f"start; os.getloadavg() = {os.getloadavg()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.model) if args.model else train_model(out / "model", args.train_steps, Path(args.corpus), args.d_model,
                                                            args.n_layers, args.seq_len, args.lr)
    model, tok, names = load_pretrained(ckpt)
    model.eval()
    cfg = model.cfg
    rng = random.Random(args.seed)

    eligible = sorted({n for n in (names or []) if re.fullmatch(r"[a-z]{4,}", n or "")})
    if len(eligible) < args.concepts:
        raise SystemExit(f"only {len(eligible)} keyword concepts in {ckpt}; need {args.concepts}")
    concepts = rng.sample(eligible, args.concepts)
    docs = read_documents(args.corpus)
    n_val = max(1, round(len(docs) * 0.1))
    pairs = make_prompts(docs[-n_val:], args.prompts, 6, 16, rng)  # held-out documents: unseen in training
    if len(pairs) < args.prompts:
        pairs += make_prompts(docs[:-n_val], args.prompts - len(pairs), 6, 16, rng)
    half = len(pairs) // 2
    tune, test = pairs[:half], pairs[half:]
    layers = [int(x) for x in args.layers.split(",") if x] or sorted({cfg.n_layers, cfg.n_layers // 2}, reverse=True)
    strengths = [float(s) for s in args.strengths.split(",")]
    log(f"model {ckpt} ({cfg.family}, {cfg.n_layers} layers, d={cfg.d_model}); concepts {concepts}; "
        f"{len(tune)} tuning + {len(test)} test prompts; strengths {strengths}; layers {layers}")

    flu = Fluency()
    kw = {"steps_per_block": cfg.block_size // 2}

    def gen(prompt: str, steering=None, prefix: str = "") -> str:
        ids = torch.tensor(tok.encode(prefix + prompt).ids)
        o = steered_generate(model, ids, args.new_tokens, steering, **kw)
        return tok.decode(o[0, len(ids):].tolist())

    # fluency anchors: real continuations (-> 2) and random vocabulary strings (-> 0)
    ref_lp = flu.log_ppl([p for p, _ in pairs], [c for _, c in pairs])
    rnd_texts = [tok.decode(torch.randint(5, tok.get_vocab_size(), (args.new_tokens,)).tolist()) for _ in pairs]
    rnd_lp = flu.log_ppl([p for p, _ in pairs], rnd_texts)
    flu.calibrate(ref_lp, rnd_lp)
    ref_distinct = statistics.median(distinct_ratio(c) for _, c in pairs)
    log(f"fluency anchors: reference ppl {math.exp(flu.lo):.1f} -> 2, random ppl {math.exp(flu.hi):.1f} -> 0; "
        f"reference distinct-word ratio {ref_distinct:.2f}")

    def score(prompts, texts, concept):
        lps = flu.log_ppl(prompts, texts)
        rows = []
        for t, lp in zip(texts, lps):
            c = concept_score(t, concept)
            q = flu.score(lp) * min(1.0, distinct_ratio(t) / ref_distinct)
            rows.append({"concept": c, "quality": q, "harmonic": harmonic(c, q), "ppl": math.exp(lp) if math.isfinite(lp) else None, "text": t})
        return rows

    results: dict[str, list] = {k: [] for k in ("unsteered", "prompting", "steered", "random")}
    chosen = {}
    unsteered_cache = {p: gen(p) for p, _ in test}
    for ci, concept in enumerate(concepts):
        # held-out selection of (strength, layer): best mean harmonic on the tuning prompts
        best = None
        grid = [(L, s) for L in layers for s in strengths]
        texts = [gen(p, make_steering(model, {concept: s}, names, layer=L)) for L, s in grid for p, _ in tune]
        rows = score([p for _ in grid for p, _ in tune], texts, concept)  # one batched fluency pass
        for gi, (L, s) in enumerate(grid):
            part = rows[gi * len(tune):(gi + 1) * len(tune)]
            h = statistics.mean(r["harmonic"] for r in part)
            c = statistics.mean(r["concept"] for r in part)
            if best is None or (h, c) > best[0]:
                best = ((h, c), s, L)
        (_, s, L) = best
        chosen[concept] = {"strength": s, "layer": L, "tune_harmonic": best[0][0]}
        st = make_steering(model, {concept: s}, names, layer=L)
        rs = random_steering(model, st, seed=args.seed * 1000 + ci)
        prompts = [p for p, _ in test]
        conds = (("unsteered", [unsteered_cache[p] for p in prompts]),
                 ("prompting", [gen(p, None, f"This text is about {concept}. ") for p in prompts]),
                 ("steered", [gen(p, st) for p in prompts]),
                 ("random", [gen(p, rs) for p in prompts]))
        rows = score(prompts * len(conds), [t for _, texts in conds for t in texts], concept)
        for k, (name, _) in enumerate(conds):
            for r in rows[k * len(prompts):(k + 1) * len(prompts)]:
                results[name].append({"concept_name": concept, **r})
        log(f"concept {ci + 1}/{len(concepts)} {concept!r}: strength {s:g} at layer {L}; "
            f"steered e.g. {results['steered'][-1]['text'][:60]!r}")

    table = {}
    for name, rows in results.items():
        table[name] = {k: statistics.mean(r[k] for r in rows) for k in ("concept", "quality", "harmonic")}
    u, p, s_, r = (table[k] for k in ("unsteered", "prompting", "steered", "random"))

    def ratio(a, b):
        return a / b if b > 0 else (float("inf") if a > 0 else float("nan"))

    ratios = {"concept_vs_random": ratio(s_["concept"], r["concept"]),
              "concept_vs_prompting": ratio(s_["concept"], p["concept"]),
              "harmonic_vs_unsteered": ratio(s_["harmonic"], u["harmonic"]),
              "quality_vs_unsteered": ratio(s_["quality"], u["quality"])}
    print()
    print(f"Steering benchmark (Table 10 format): {len(concepts)} random concepts x {len(test)} test prompts; "
          f"concept = keyword scorer, quality = Gemma-3-270M perplexity mapped to 0-2 x repetition factor")
    print("| condition | concept (0-2) | quality (0-2) | harmonic |")
    print("|---|---|---|---|")
    for name in ("unsteered", "prompting", "steered", "random"):
        t = table[name]
        print(f"| {name} | {t['concept']:.3f} | {t['quality']:.3f} | {t['harmonic']:.3f} |")
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.3f} (goal >= {GOALS[k]}) {'PASS' if v >= GOALS[k] else 'MISS'}")
    print(f"chosen strength/layer per concept: {chosen}")
    print(f"wall {time.perf_counter() - t0:.0f} s; os.getloadavg() = {os.getloadavg()} (shared machine: rough)")
    (out / "results.json").write_text(json.dumps({"table": table, "ratios": ratios, "goals": GOALS, "chosen": chosen,
                                                  "concepts": concepts, "rows": results, "model": str(ckpt),
                                                  "fluency_anchor_ppl": [math.exp(flu.lo), math.exp(flu.hi)],
                                                  "reference_distinct_ratio": ref_distinct,
                                                  "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()

"""Concept steering benchmark (paper Table 10, AxBench protocol) on a small Steerling model.

Random known concepts x prompts, four conditions:
  unsteered   plain generation (temperature 0.7 by default; every condition of a prompt
              draws the same sampling noise)
  prompting   the concept named in the context: "This text is about <concept>. " + prompt
  steered     concept direction injected (model/steering.py), strength/layer per concept
              chosen on a held-out prompt split (best mean harmonic score)
  random      a random direction with the steered delta's norm, same layer

Scores (0-2 each, as AxBench's ratings):
  concept  2 x the probability Atlas's Stage 3 fast annotator (atlas/stage3) gives the concept
           for the continuation alone. The model's concepts are the stand-in labeller's
           (model/labels.py); the annotator is trained here, through the real Stage 3 trainer
           on a local Ray, on ~continuation-sized windows of the model's training documents
           labelled with those concepts (its held-out F1 and a random-label control are
           printed), or loaded with --annotator. Keyword concepts only (the word itself is
           the rule), so a whole-word count 0 / 1 / 2 is reported beside it as a cross-check.
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

The model is trained here (WikiText-2 from ../shared when present, else the demo corpus;
~15 min for the default 3,000 steps on 2 cores) unless --model points at one trained on the
same --corpus. Prints load average: timings/scores are from a shared machine.
Usage: python benchmarks/steering.py [--model DIR] [--annotator DIR] [--out DIR] [--quick]
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
import zlib
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig, TrainConfig  # noqa: E402
from model.corpus import read_documents, sections_of  # noqa: E402
from model.labels import StandInLabeller  # noqa: E402
from model.io import load_pretrained  # noqa: E402
from model.steering import make_steering, random_steering, steered_generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "atlas" / "demo" / "corpus"
WIKITEXT2 = ROOT.parent / "shared" / "data" / "corpus" / "wikitext2"  # 124 articles; the demo's 10 when absent
GOALS = {"concept_vs_random": 2.0, "concept_vs_prompting": 1.0, "harmonic_vs_unsteered": 10.0,
         "quality_vs_unsteered": 0.85}


def log(msg: str) -> None:
    print(f"[steering {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", flush=True)


# ----------------------------------------------------------------------------- model
def train_model(out: Path, steps: int, corpus: Path, d_model: int = 128, n_layers: int = 4, seq_len: int = 128,
                lr: float = 3e-3, family: str = "cdlm_concept", batch_size: int = 8, n_known: int = 48,
                aux_backbone_grad: float = 1.0, threads: int | None = None) -> Path:
    from model.loop import train

    mc = ModelConfig.preset("tiny", family=family, vocab_size=2048, d_model=d_model, n_layers=n_layers,
                            n_heads=4, n_kv_heads=2, max_seq_len=seq_len, block_size=16, n_known=n_known,
                            n_unknown=3 * n_known, topk_known=4, topk_unknown=8)
    tc = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, chunk_len=min(64, seq_len), lr=lr,
                     warmup_steps=min(100, steps // 10 + 1), eval_every=max(1, steps // 4), eval_batches=4, seed=0,
                     val_fraction=0.1, aux_backbone_grad=aux_backbone_grad, threads=threads)
    res = train(mc, tc, str(corpus), out_dir=out, progress=True, device="cpu")
    log(f"trained: val_loss {res.final['val_loss']:.3f}, concept AUC {res.final.get('concept_auc')}")
    return Path(res.checkpoint)


# ----------------------------------------------------------------------------- scorers
def keyword_count_score(text: str, concept: str) -> int:
    """Cross-check only: 0 / 1 / 2 for 0 / 1 / >= 2 whole-word occurrences of a keyword concept."""
    n = len(re.findall(rf"\b{re.escape(concept.lower())}s?\b", text.lower()))
    return 0 if n == 0 else (1 if n == 1 else 2)


def annotator_training_chunks(docs: list[str], labeller, window_words: int):
    """Stage 3 teacher set from the model's own training documents: ~continuation-sized word
    windows, each labelled with the concepts the model was trained on (labeller + section)."""
    from atlas.stage3.labels import LabelledChunks, library_version
    from model.corpus import split_sections

    ids, doc_ids, texts, rows = [], [], [], []
    for d, doc in enumerate(docs):
        for head, text in split_sections(doc):
            words = [w for w in text.split() if not w.startswith("=")]
            for i in range(0, len(words) - window_words // 2, window_words):
                t = " ".join(words[i:i + window_words])
                ids.append(f"d{d}-w{len(ids)}")
                doc_ids.append(f"d{d}")
                texts.append(t)
                rows.append(labeller.label(t, head))
    y = np.zeros((len(texts), labeller.n_concepts), np.uint8)
    for r, lab in enumerate(rows):
        y[r, lab] = 1
    concept_ids = list(labeller.names)
    return LabelledChunks(ids, doc_ids, texts, y, concept_ids, library_version(concept_ids))


class AnnotatorConcepts:
    """Concept score = 2 x the Stage 3 annotator's probability of the concept for the
    continuation (0-2, AxBench's range). The annotator is Atlas's fast Stage 3 annotator
    (atlas/stage3), trained here on the model's training documents and concept labels, or
    loaded from ``--annotator`` (a Stage 3 annotator directory over the same concepts)."""

    def __init__(self, docs: list[str], labeller, names: list[str], annotator_uri: str | None, window_words: int):
        from atlas import storage
        from atlas.stage3.annotators import Annotator

        if annotator_uri:
            self.ann = Annotator.load(storage.resolve(annotator_uri))
            self.eval = None
        else:
            self.ann, self.eval = self._train(annotator_training_chunks(docs, labeller, window_words))
        self.index = {}
        for cid in self.ann.cfg.concept_ids:  # "kw:word" / "section:head" or plain names
            self.index[cid.partition(":")[2] or cid] = len(self.index)
        missing = [n for n in names if n and n not in self.index]
        if missing:
            raise SystemExit(f"annotator has no concept(s) {missing[:5]} of the model")

    def usable(self, name: str) -> bool:
        """The annotator can predict it (Stage 3 leaves rare concepts out with a threshold > 1)."""
        return self.ann.cfg.thresholds[self.index[name]] <= 1.0

    @staticmethod
    def _train(data):
        from atlas.cluster import ray_session
        from atlas.config import RayConfig, Stage3Config
        from atlas.stage3.evaluate import evaluate
        from atlas.stage3.train import train_annotator

        s3 = Stage3Config(cpus_per_actor=0.5, cpus_per_train_worker=0.5)
        with ray_session(RayConfig(num_cpus=2, object_store_memory_mb=512)):
            ann, info = train_annotator("fast", data, s3)
        test = info["split"] == "test"
        res = evaluate(ann.decide(info["test_scores"]), data.y[test], n_boot=200)
        log(f"Stage 3 fast annotator on {len(data)} teacher windows ({int(test.sum())} held out): micro-F1 "
            f"{res['annotator']['micro_f1']:.3f} (random-label control {res['random_control']['micro_f1']:.3f}), "
            f"macro-F1 {res['annotator']['macro_f1']:.3f}")
        return ann, {k: {m: v[m] for m in ("micro_f1", "macro_f1", "kappa")} for k, v in res.items()}

    def scores(self, texts: list[str], concept: str) -> list[float]:
        return [2.0 * float(p) for p in self.ann.scores(texts)[:, self.index[concept]]]


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
    ap.add_argument("--model", help="saved Steerling checkpoint trained on --corpus (default: train one here)")
    ap.add_argument("--annotator", help="Stage 3 annotator directory over the model's concepts (default: train one here)")
    ap.add_argument("--out", default="benchmark-steering", help="output folder (model, results.json)")
    ap.add_argument("--corpus", default=str(WIKITEXT2 if WIKITEXT2.exists() else DEMO))
    ap.add_argument("--family", default="cdlm_concept", choices=["cdlm_concept", "ar_concept"])
    ap.add_argument("--train-steps", type=int, default=3000)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--n-known", type=int, default=64)
    ap.add_argument("--aux-backbone-grad", type=float, default=0.1,
                    help="share of the concept losses' gradient into the backbone (1 = the paper's sum; see model/README.md)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--concepts", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16, help="half held out for strength selection, half for test")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--window-words", type=int, default=20, help="annotator teacher windows (about a continuation)")
    ap.add_argument("--strengths", default="2,4,8,16", help="logit units tried on the held-out split")
    ap.add_argument("--layers", default="", help="injection layers tried (default: n_layers and n_layers//2)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy (tiny models loop: 'and and and')")
    ap.add_argument("--steps-per-block", type=int, default=0, help="diffusion steps per block (default: block size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="300 training steps, 3 concepts x 4 prompts, 2 strengths")
    args = ap.parse_args()
    if args.quick:
        args.train_steps, args.concepts, args.prompts, args.strengths = 300, 3, 4, "4,16"
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    log(f"start; os.getloadavg() = {os.getloadavg()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.model) if args.model else train_model(
        out / "model", args.train_steps, Path(args.corpus), args.d_model, args.n_layers, args.seq_len, args.lr,
        args.family, args.batch_size, args.n_known, args.aux_backbone_grad, args.threads)
    model, tok, names = load_pretrained(ckpt)
    model.eval()
    cfg = model.cfg
    rng = random.Random(args.seed)

    # The model's concepts: the stand-in labeller refit exactly as training fit it (same
    # documents, same split), checked against the names saved with the checkpoint.
    docs = read_documents(args.corpus)
    n_val = max(1, round(len(docs) * 0.1))
    labeller = StandInLabeller.fit(sections_of(docs[:-n_val]), cfg.n_known)
    if [labeller.display_name(i) for i in range(labeller.n_concepts)] != list(names[:labeller.n_concepts]):
        raise SystemExit(f"{ckpt} was not trained on {args.corpus} with a 10% validation split (concept names differ)")
    scorer = AnnotatorConcepts(docs[:-n_val], labeller, names[:labeller.n_concepts], args.annotator, args.window_words)
    eligible = sorted(labeller.display_name(i) for i, n in enumerate(labeller.names)
                      if n.startswith("kw:") and scorer.usable(labeller.display_name(i)))
    if len(eligible) < args.concepts:
        raise SystemExit(f"only {len(eligible)} keyword concepts the annotator predicts in {ckpt}; need {args.concepts}")
    concepts = rng.sample(eligible, args.concepts)
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
    kw = {"steps_per_block": args.steps_per_block or cfg.block_size}

    # WikiText's "<unk>" placeholder (BPE pieces "<", "unk", ">") is never generated, in every
    # condition: it is the corpus's mark for a removed word, not text a reader would rate.
    # Likewise its heading markup (" = = Title = = ", pieces made only of "="): layout, not prose;
    # left allowed, a strong steer collapses into "= = = =" that no fluency rating would accept.
    kw["forbid"] = sorted(i for t, i in tok.get_vocab().items()
                          if t.lstrip("Ġ") in ("<", "unk", ">", "unk>") or re.fullmatch("=+", t.lstrip("Ġ")))

    def gen(prompt: str, steering=None, prefix: str = "") -> str:
        # Sampling noise seeded by the prompt alone: every condition of a prompt draws the same
        # uniforms, so the conditions differ by the intervention, not by luck.
        ids = torch.tensor(tok.encode(prefix + prompt).ids)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(prompt.encode()))
        o = steered_generate(model, ids, args.new_tokens, steering, temperature=args.temperature, generator=g, **kw)
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
        for t, lp, c in zip(texts, lps, scorer.scores(texts, concept)):
            q = flu.score(lp) * min(1.0, distinct_ratio(t) / ref_distinct)
            rows.append({"concept": c, "keyword": keyword_count_score(t, concept), "quality": q, "harmonic": harmonic(c, q),
                         "ppl": math.exp(lp) if math.isfinite(lp) else None, "text": t})
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
        table[name] = {k: statistics.mean(r[k] for r in rows) for k in ("concept", "keyword", "quality", "harmonic")}
    u, p, s_, r = (table[k] for k in ("unsteered", "prompting", "steered", "random"))

    # A baseline near 0 makes any ratio huge and meaningless: denominators are floored at the
    # score resolution, one rating step (1 of 0-2) on one of the scored texts, and reported as such.
    floor = 1.0 / len(results["steered"])

    def ratio(a, b):
        return a / max(b, floor)

    ratios = {"concept_vs_random": ratio(s_["concept"], r["concept"]),
              "concept_vs_prompting": ratio(s_["concept"], p["concept"]),
              "harmonic_vs_unsteered": ratio(s_["harmonic"], u["harmonic"]),
              "quality_vs_unsteered": ratio(s_["quality"], u["quality"])}
    print()
    print(f"Steering benchmark (Table 10 format): {len(concepts)} random concepts x {len(test)} test prompts; "
          f"concept = 2 x Stage 3 annotator probability, quality = Gemma-3-270M perplexity mapped to 0-2 x repetition "
          f"factor; keyword = whole-word count 0/1/2 (cross-check)")
    print("| condition | concept (0-2) | quality (0-2) | harmonic | keyword (0-2) |")
    print("|---|---|---|---|---|")
    for name in ("unsteered", "prompting", "steered", "random"):
        t = table[name]
        print(f"| {name} | {t['concept']:.3f} | {t['quality']:.3f} | {t['harmonic']:.3f} | {t['keyword']:.3f} |")
    print()
    denominators = {"concept_vs_random": r["concept"], "concept_vs_prompting": p["concept"],
                    "harmonic_vs_unsteered": u["harmonic"], "quality_vs_unsteered": u["quality"]}
    for k, v in ratios.items():
        floored = f" (baseline {denominators[k]:.4f} floored at {floor:.4f})" if denominators[k] < floor else ""
        print(f"{k}: {v:.3f}{floored} (goal >= {GOALS[k]}) {'PASS' if v >= GOALS[k] else 'MISS'}")
    print(f"chosen strength/layer per concept: {chosen}")
    print(f"wall {time.perf_counter() - t0:.0f} s; os.getloadavg() = {os.getloadavg()} (shared machine: rough)")
    (out / "results.json").write_text(json.dumps({"table": table, "ratios": ratios, "goals": GOALS, "ratio_floor": floor,
                                                  "chosen": chosen,
                                                  "concepts": concepts, "rows": results, "model": str(ckpt),
                                                  "fluency_anchor_ppl": [math.exp(flu.lo), math.exp(flu.hi)],
                                                  "reference_distinct_ratio": ref_distinct, "annotator_eval": scorer.eval,
                                                  "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()

"""`atlas explain`, `atlas steer` and `atlas index-training-data`: Steerling attributions and
steering from the command line, written as a self-contained HTML report (model/report.py)."""

from __future__ import annotations

import argparse
import json
import sys


def _load(path: str):
    from model.io import load_pretrained

    model, tok, names = load_pretrained(path)
    if tok is None:
        raise SystemExit(f"atlas: {path} has no tokenizer.json; cannot encode a prompt")
    return model.eval(), tok, names


def _index(args, model, tok):
    from model import retrieval

    if args.no_index:
        return None
    if args.index:
        return retrieval.TrainingDataIndex.load(args.index)
    idx = retrieval.load_for_model(args.model)
    if idx is None and args.corpus:
        idx = retrieval.build_and_save(model, tok, args.model, args.corpus, args.chunk_len, args.val_fraction)
    return idx


def _parse_concepts(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, sep, val = item.rpartition("=")
        if not sep or not name:
            raise SystemExit(f"atlas: --concept wants NAME=STRENGTH (logit units, negative suppresses), got {item!r}")
        try:
            out[int(name) if name.isdigit() else name] = float(val)
        except ValueError:
            raise SystemExit(f"atlas: strength of {name!r} is not a number: {val!r}") from None
    return out


def _explain(args: argparse.Namespace, steering_spec: dict | None = None) -> int:
    import torch

    from model.attribution import COMPLETENESS_BOUND
    from model.report import explain, write_report
    from model.steering import make_steering

    torch.set_num_threads(args.threads) if args.threads else None
    model, tok, names = _load(args.model)
    steering = None
    if steering_spec:
        try:
            steering = make_steering(model, steering_spec, names, layer=args.layer)
        except (KeyError, ValueError) as e:
            print(f"atlas: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
    index = _index(args, model, tok)
    ex = explain(model, tok, args.prompt, names, args.max_new_tokens, args.steps_per_block, args.ig_steps, args.top,
                 index, args.k, steering, model_name=args.model,
                 ig_refine_to=None if args.no_ig_refine else COMPLETENESS_BOUND)
    title = "Steerling steering report" if steering else "Steerling explanation"
    path = write_report(ex, args.out, title)
    if args.json:
        print(ex.to_json())
    else:
        if ex.unsteered_text is not None:
            print(f"unsteered: {ex.unsteered_text}")
        print(f"generated: {ex.text}")
        if ex.concepts_group:
            tops = ", ".join(f"{c['name']} ({c['value']:+.2f})" for c in ex.concepts_group["known"])
            print(f"top known concepts: {tops}")
        print(f"IG completeness error: whole {100 * ex.ig_group_error:.2f}%, worst token {100 * max(ex.ig_errors):.2f}% "
              f"({args.ig_steps} steps, up to {max(ex.ig_token_steps)} where refined)")
        for h in ex.retrieval[:3]:
            print(f"  chunk {h['chunk_id']} ({h['score']:.3f}): {h['text'][:80]!r}")
        print(f"report: {path}")
    return 0


def _steer(args: argparse.Namespace) -> int:
    return _explain(args, _parse_concepts(args.concept))


def _build_index(args: argparse.Namespace) -> int:
    from model import retrieval

    model, tok, _ = _load(args.model)
    idx = retrieval.build_and_save(model, tok, args.out or args.model, args.corpus, args.chunk_len, args.val_fraction)
    print(json.dumps({"index": retrieval.index_uri(args.out or args.model), **idx.meta}))
    return 0


def add_commands(sub) -> None:
    def common(sp):
        sp.add_argument("model", help="Steerling checkpoint directory (model.safetensors + config.json + tokenizer.json)")
        sp.add_argument("prompt")
        sp.add_argument("--max-new-tokens", type=int, default=32)
        sp.add_argument("--steps-per-block", type=int, help="diffusion steps per block (default: block size)")
        sp.add_argument("--ig-steps", type=int, default=32, help="Integrated Gradients steps")
        sp.add_argument("--no-ig-refine", action="store_true",
                        help="keep --ig-steps even where a token's completeness error exceeds 5%%")
        sp.add_argument("--top", type=int, default=5, help="concepts shown per token")
        sp.add_argument("--k", type=int, default=5, help="training chunks retrieved")
        sp.add_argument("--index", help="training-data index URI (default: <model>/retrieval)")
        sp.add_argument("--corpus", help="build the index beside the model from this corpus if it has none")
        sp.add_argument("--chunk-len", type=int, default=64)
        sp.add_argument("--val-fraction", type=float, default=None)
        sp.add_argument("--no-index", action="store_true", help="skip training-data retrieval")
        sp.add_argument("--threads", type=int)
        sp.add_argument("--json", action="store_true", help="print the explanation as JSON")

    e = sub.add_parser("explain", help="explain a Steerling generation (input tokens, concepts, training data) as HTML")
    common(e)
    e.add_argument("--out", default="explain.html", help="HTML report path")
    e.set_defaults(func=_explain)

    s = sub.add_parser("steer", help="generate with concepts amplified/suppressed and explain it as HTML")
    common(s)
    s.add_argument("--concept", action="append", required=True, metavar="NAME=STRENGTH",
                   help="concept name or id and strength in logit units (negative suppresses); repeatable")
    s.add_argument("--layer", type=int, help="inject at layers >= this (default: n_layers, the final hidden state)")
    s.add_argument("--out", default="steer.html", help="HTML report path")
    s.set_defaults(func=_steer)

    i = sub.add_parser("index-training-data", help="build the FAISS training-data index beside a Steerling model")
    i.add_argument("model")
    i.add_argument("corpus", help=".txt file or directory of the training corpus")
    i.add_argument("--chunk-len", type=int, default=64)
    i.add_argument("--val-fraction", type=float, default=None, help="hold out the last documents as training did")
    i.add_argument("--out", help="model URI to store beside (default: the model directory; s3:// allowed)")
    i.set_defaults(func=_build_index)

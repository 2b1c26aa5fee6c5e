"""``atlas concepts ...``: commands over a run's concept library (thin: calls atlas.stage2)."""

from __future__ import annotations

import json


def _load(uri: str, endpoint: str | None):
    from atlas import storage
    from atlas.config import StorageConfig

    root = storage.resolve(uri, StorageConfig(s3_endpoint=endpoint))
    return storage.read_table(root, "concepts", columns=["concept_id", "name"]), storage.read_table(root, "tag_concepts", columns=["tag", "concept_id"])


def _diff(args) -> int:
    from atlas.stage2.diff import diff, format_diff

    ca, ta = _load(args.run_a, args.s3_endpoint)
    cb, tb = _load(args.run_b, args.s3_endpoint)
    d = diff(ca, ta, cb, tb)
    print(json.dumps(d, indent=2) if args.json else format_diff(d))
    return 0


def _blind_export(args) -> int:
    import pyarrow.csv as pcsv

    from atlas import storage
    from atlas.config import StorageConfig
    from atlas.stage2 import validate

    scfg = StorageConfig(s3_endpoint=args.s3_endpoint)
    root = storage.resolve(args.run, scfg)
    concepts = storage.read_table(root, "concepts", columns=["concept_id", "name", "representative_tags", "taxonomy_class", "embedding"])
    sheet, key = validate.export_sheet(concepts, n=args.n, seed=args.seed)
    if args.llm_rate:
        from atlas.config import EngineConfig
        from atlas.engine import Engine

        sheet = validate.llm_rate(sheet, Engine(EngineConfig(), model=args.model, storage_cfg=scfg), cache_root=root)
    pcsv.write_csv(sheet, f"{args.out}.sheet.csv")
    pcsv.write_csv(key, f"{args.out}.key.csv")
    print(f"wrote {args.out}.sheet.csv ({sheet.num_rows} items) and {args.out}.key.csv (keep the key from raters)")
    return 0


def _blind_score(args) -> int:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from atlas.stage2 import validate

    opts = pcsv.ConvertOptions(column_types={"rating": pa.int8(), "rater": pa.string()})
    res = validate.score(pcsv.read_csv(args.sheet, convert_options=opts), pcsv.read_csv(args.key))
    print("| candidate | n | mean | sd | 95% CI | raters |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in res.to_pylist():
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {r['candidate_type']} | {r['n']} | {f(r['mean'])} | {f(r['sd'])} | {f(r['ci_low'])}..{f(r['ci_high'])} | {r['raters']} |")
    return 0


def add_commands(sub) -> None:
    c = sub.add_parser("concepts", help="inspect and compare Stage 2 concept libraries")
    csub = c.add_subparsers(dest="concepts_cmd", required=True)
    d = csub.add_parser("diff", help="list concepts added, removed, renamed and merged between two runs")
    d.add_argument("run_a", help="output root URI of the earlier run")
    d.add_argument("run_b", help="output root URI of the later run")
    d.add_argument("--s3-endpoint", help="S3 endpoint override")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_diff)
    be = csub.add_parser("blind-export", help="export a blind-fit rating sheet (+ key) of a run's concepts")
    be.add_argument("run")
    be.add_argument("out", help="path prefix: writes <out>.sheet.csv and <out>.key.csv")
    be.add_argument("--n", type=int, help="concepts to sample (default: all)")
    be.add_argument("--seed", type=int, default=0)
    be.add_argument("--llm-rate", action="store_true", help="fill the ratings with an LLM rater (marked llm:<model>)")
    be.add_argument("--model", default="embedded:smollm2-135m-instruct", help="LLM rater model")
    be.add_argument("--s3-endpoint", help="S3 endpoint override")
    be.set_defaults(func=_blind_export)
    bs = csub.add_parser("blind-score", help="score a filled blind-fit sheet: mean, sd, n, 95%% CI per candidate type")
    bs.add_argument("sheet")
    bs.add_argument("key")
    bs.set_defaults(func=_blind_score)

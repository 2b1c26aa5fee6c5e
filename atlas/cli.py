"""`atlas` command line: parses arguments and calls the library; no logic of its own."""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources

from atlas.config import ConfigError, load_config

DEMO_OUTPUT = "atlas-demo-output"


def _run(args: argparse.Namespace) -> int:
    from atlas import logs, manifest as mf, runner, storage
    from atlas.console import RunConsole
    from atlas.stage import StageError

    cfg = load_config(args.config, overrides=args.set, input=args.input, output=args.output, run_id=args.run_id).with_run_id()
    if args.address:
        cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"address": args.address})})
    log_file = args.log_file or default_log_file(cfg)
    logs.setup(log_file, console_level="WARNING")
    con = RunConsole(log_file=log_file).install()
    try:
        manifest = runner.run(cfg, tuple(args.stages) if args.stages else None, force=args.force, console=con)
    except StageError as e:
        try:
            con.summary(mf.load(storage.resolve(cfg.output, cfg.storage)))
        except Exception:  # noqa: BLE001 - the summary is a courtesy; the error below is the message
            pass
        print(f"atlas: {e}\nlog: {log_file}", file=sys.stderr)
        return 1
    finally:
        con.uninstall()
    con.summary(manifest)
    con.console.print(f"log: {log_file}")
    return 0


def default_log_file(cfg) -> str:
    """Where a run's JSON-lines log goes without --log-file: beside a local output
    (<output>/_logs/<run id>.jsonl), else under ./atlas-logs/ (the log is local, the tables
    may be on S3)."""
    from atlas import storage

    root = storage.resolve(cfg.output, cfg.storage)
    folder = os.path.abspath("atlas-logs") if root.is_s3 else os.path.join(root.path, "_logs")
    return os.path.join(folder, f"{cfg.run_id}.jsonl")


def _demo(args: argparse.Namespace) -> int:
    corpus = resources.files("atlas") / "demo" / "corpus"
    demo_cfg = resources.files("atlas") / "demo" / "demo.yaml"
    args.input = str(corpus)
    args.output = args.output or os.path.abspath(DEMO_OUTPUT)
    args.config = args.config or str(demo_cfg)
    rc = _run(args)
    if rc == 0:
        show_concepts(args.output)
    return rc


# The demo's closing example: the library's most frequent concepts in the annotated corpus.
# annotation_concepts.concept_id indexes the library sorted by concept_id (docs/tables.md).
SAMPLE_QUERY = """WITH lib AS (SELECT ROW_NUMBER() OVER (ORDER BY concept_id) - 1 AS concept, name FROM concepts)
SELECT lib.name AS concept, count(*) AS chunks FROM annotation_concepts a JOIN lib ON a.concept_id = lib.concept
GROUP BY lib.name ORDER BY chunks DESC, concept LIMIT 10"""


def show_concepts(output: str) -> None:
    """Where the concept tables are, and a sample query over them with its result."""
    from atlas import query
    from atlas.stage import load_stages

    present = set(query.tables(output))
    if not {"concepts", "annotation_concepts"} <= present:
        return
    stages = load_stages()
    concept_tables = [t for s in ("stage2_concepts", "stage3_annotate") for t in stages[s].outputs if t in present]
    print(f"\nconcept tables in {output}: " + ", ".join(concept_tables))
    one_line = " ".join(SAMPLE_QUERY.split())
    print(f'sample query:\n  atlas query {output} "{one_line}"')
    print(query.sql(output, SAMPLE_QUERY))


def _print_status(manifest: dict) -> None:
    from atlas.console import print_summary

    print_summary(manifest)


def _status(args: argparse.Namespace) -> int:
    from atlas import manifest as mf, storage
    from atlas.config import StorageConfig

    scfg = StorageConfig(s3_endpoint=args.s3_endpoint, s3_allow_http=args.s3_allow_http)
    data = mf.load(storage.resolve(args.output, scfg))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_status(data)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from atlas.engine import resolve_model

    for name in args.models:
        print(f"{name}: {resolve_model(name if ':' in name or '/' in name else 'embedded:' + name)}")
    return 0


def _schemas(args: argparse.Namespace) -> int:
    from atlas import schemas

    print(schemas.describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atlas", description="Atlas: build a concept library from a corpus on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    def add_run_flags(sp: argparse.ArgumentParser, need_io: bool) -> None:
        sp.add_argument("--input", required=need_io, help="corpus folder, file:// or s3:// prefix of .txt/.jsonl/.parquet")
        sp.add_argument("--output", required=need_io, help="output root URI (file:// or s3://)")
        sp.add_argument("--config", help="run config YAML")
        sp.add_argument("--address", help="Ray address (default: start a local cluster)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. stage1.max_tags=8")
        sp.add_argument("--stages", nargs="+", help="run only these stages (in order)")
        sp.add_argument("--run-id", help="run id (default: time + random suffix)")
        sp.add_argument("--log-file", help="JSON-lines log file (Ray's own log lines go here too); default: <output>/_logs/<run id>.jsonl")
        sp.add_argument("--force", action="store_true", help="rerun stages even when they are up to date")

    r = sub.add_parser("run", help="run the pipeline stages on a corpus")
    add_run_flags(r, need_io=True)
    r.set_defaults(func=_run)

    d = sub.add_parser("demo", help=f"run the pipeline on the bundled demo corpus (output: ./{DEMO_OUTPUT})")
    add_run_flags(d, need_io=False)
    d.set_defaults(func=_demo)

    s = sub.add_parser("status", help="show a run's manifest")
    s.add_argument("output", help="the run's output root URI")
    s.add_argument("--s3-endpoint", help="S3 endpoint override")
    s.add_argument("--s3-allow-http", action="store_true", help="allow a plain-http endpoint (local test server)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)

    q = sub.add_parser("query", help="run SQL over a run's tables, e.g. \"SELECT tag, count(*) FROM tag_judge_by_tag ...\"")
    q.add_argument("output", help="the run's output root URI")
    q.add_argument("sql")
    q.add_argument("--s3-endpoint", help="S3 endpoint override")
    q.add_argument("--s3-allow-http", action="store_true", help="allow a plain-http endpoint (local test server)")
    q.add_argument("--limit", type=int, default=20)
    q.add_argument("--csv", action="store_true", help="print all rows as CSV")
    from atlas import cli_query

    cli_query.extend(q)  # --format csv|json|parquet, --out

    m = sub.add_parser("prepare-model", help="convert packaged GGUF models to cached Hugging Face directories")
    m.add_argument("models", nargs="*", default=["gemma3-270m"], help="embedded model names or HF paths")
    m.set_defaults(func=_prepare)

    sc = sub.add_parser("schemas", help="print the tables' schemas as Markdown")
    sc.set_defaults(func=_schemas)

    from atlas import cli_concepts, cli_explain, cli_scaling, cli_train

    for module in (cli_scaling, cli_train, cli_concepts, cli_explain):
        module.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"atlas: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

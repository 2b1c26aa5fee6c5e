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


def add_commands(sub) -> None:
    c = sub.add_parser("concepts", help="inspect and compare Stage 2 concept libraries")
    csub = c.add_subparsers(dest="concepts_cmd", required=True)
    d = csub.add_parser("diff", help="list concepts added, removed, renamed and merged between two runs")
    d.add_argument("run_a", help="output root URI of the earlier run")
    d.add_argument("run_b", help="output root URI of the later run")
    d.add_argument("--s3-endpoint", help="S3 endpoint override")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_diff)

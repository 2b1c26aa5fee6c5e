"""Compare the concept libraries of two runs: added, removed, renamed and merged concepts.

* renamed: the same concept id in both runs with a different name;
* merged: a concept of run B that took the majority of the tags of two or more concepts of
  run A (those A concepts are then neither "removed" nor is the B concept "added");
* added / removed: ids present in only one run and not explained by a merge.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc


def _tag_map(tag_concepts: pa.Table) -> dict[str, str]:
    t = tag_concepts.filter(pc.is_valid(tag_concepts.column("concept_id")))
    return dict(zip(t.column("tag").to_pylist(), t.column("concept_id").to_pylist()))


def diff(concepts_a: pa.Table, tags_a: pa.Table, concepts_b: pa.Table, tags_b: pa.Table) -> dict:
    name_a = dict(zip(concepts_a.column("concept_id").to_pylist(), concepts_a.column("name").to_pylist()))
    name_b = dict(zip(concepts_b.column("concept_id").to_pylist(), concepts_b.column("name").to_pylist()))
    map_a, map_b = _tag_map(tags_a), _tag_map(tags_b)
    # Where did each A concept's tags go in B? (tags absent from B are not counted)
    dest: dict[str, Counter] = {}
    for tag, ca in map_a.items():
        cb = map_b.get(tag)
        if cb is not None:
            dest.setdefault(ca, Counter())[cb] += 1
    n_tags_a = Counter(map_a.values())
    absorbed: dict[str, list[str]] = {}
    for ca, cnt in dest.items():
        cb, n = cnt.most_common(1)[0]
        if n * 2 > n_tags_a[ca]:
            absorbed.setdefault(cb, []).append(ca)
    merged = [
        {"into": cb, "name": name_b.get(cb), "from": sorted(srcs), "from_names": [name_a.get(s) for s in sorted(srcs)]}
        for cb, srcs in sorted(absorbed.items())
        if len(srcs) >= 2
    ]
    in_merge_a = {s for m in merged for s in m["from"]}
    in_merge_b = {m["into"] for m in merged}
    renamed = [
        {"concept_id": c, "old": name_a[c], "new": name_b[c]} for c in sorted(set(name_a) & set(name_b)) if name_a[c] != name_b[c] and c not in in_merge_b
    ]
    added = [{"concept_id": c, "name": name_b[c]} for c in sorted(set(name_b) - set(name_a)) if c not in in_merge_b]
    removed = [{"concept_id": c, "name": name_a[c]} for c in sorted(set(name_a) - set(name_b)) if c not in in_merge_a]
    return {
        "added": added,
        "removed": removed,
        "renamed": renamed,
        "merged": merged,
        "unchanged": sum(1 for c in set(name_a) & set(name_b) if name_a[c] == name_b[c] and c not in in_merge_b),
    }


def format_diff(d: dict) -> str:
    lines = [
        f"added {len(d['added'])}, removed {len(d['removed'])}, renamed {len(d['renamed'])}, merged {len(d['merged'])}, unchanged {d['unchanged']}"
    ]
    for a in d["added"]:
        lines.append(f"+ {a['concept_id']}  {a['name']}")
    for r in d["removed"]:
        lines.append(f"- {r['concept_id']}  {r['name']}")
    for r in d["renamed"]:
        lines.append(f"~ {r['concept_id']}  {r['old']!r} -> {r['new']!r}")
    for m in d["merged"]:
        lines.append(f"= {m['into']}  {m['name']!r} <- " + ", ".join(f"{s} {n!r}" for s, n in zip(m["from"], m["from_names"])))
    return "\n".join(lines)

"""Mapping concepts onto the Library of Congress Classification outline (shipped in
atlas/data/taxonomy/, provenance beside it), and the distribution plot by top class (Fig. 12).

How a concept is mapped: every outline node is embedded once as its caption followed by its
subclass caption ("Algebra; Mathematics"), with the same sentence-transformers model as the
tags (cached under ~/.cache/atlas/taxonomy/). A concept ("name: description") takes the
``top_k`` nodes by cosine; without an LLM the best one wins, with ``taxonomy_llm_pick`` the
LLM picks among those candidates (choice-constrained answer, so it can only name one of
them). The path is class > subclass > ancestors > node, as captions.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from atlas.stage2.embed import encode, resolve_embedding_model, to_matrix

OUTLINE = Path(__file__).resolve().parents[1] / "data" / "taxonomy" / "lcc_outline.json.gz"

LCC_CLASSES = {
    "A": "General works",
    "B": "Philosophy, psychology, religion",
    "C": "Auxiliary sciences of history",
    "D": "World history",
    "E": "History of the Americas",
    "F": "History of the Americas (local)",
    "G": "Geography, anthropology, recreation",
    "H": "Social sciences",
    "J": "Political science",
    "K": "Law",
    "L": "Education",
    "M": "Music",
    "N": "Fine arts",
    "P": "Language and literature",
    "Q": "Science",
    "R": "Medicine",
    "S": "Agriculture",
    "T": "Technology",
    "U": "Military science",
    "V": "Naval science",
    "Z": "Bibliography, library science",
}


@functools.lru_cache(maxsize=1)
def load_outline() -> list[dict]:
    """Outline nodes with ``path`` (captions, class first) and ``text`` (what is embedded)."""
    nodes = json.loads(gzip.decompress(OUTLINE.read_bytes()))["nodes"]
    by_id = {n["id"]: n for n in nodes}
    # A subclass's caption is that of its widest root node (e.g. QA1-939 "Mathematics").
    widest: dict[str, dict] = {}
    for n in nodes:
        span = (n.get("stop") or 0) - (n.get("start") or 0)
        if not n["parents"] and (n["prefix"] not in widest or span > widest[n["prefix"]]["_span"]):
            widest[n["prefix"]] = {**n, "_span": span}
    sub_caption = {p: n["subject"] for p, n in widest.items()}
    out = []
    for n in nodes:
        anc = [by_id[p]["subject"] for p in sorted(n["parents"], key=lambda p: len(by_id[p]["parents"]) if p in by_id else 0) if p in by_id]
        cls = n["prefix"][0]
        sub = sub_caption.get(n["prefix"], n["prefix"])
        path = [f"{cls} {LCC_CLASSES.get(cls, cls)}", f"{n['prefix']} {sub}"]
        path += [a for a in anc if a != sub] + ([n["subject"]] if n["subject"] != sub or not anc else [])
        text = n["subject"] if n["subject"] == sub else f"{n['subject']}; {sub}"
        out.append({"id": n["id"], "prefix": n["prefix"], "class": cls, "path": path, "text": text})
    return out


def node_embeddings(model: str) -> np.ndarray:
    """Embeddings of every outline node's text, cached per (model, outline) on disk."""
    nodes = load_outline()
    key = hashlib.sha256((resolve_embedding_model(model) + "\0" + hashlib.sha256(OUTLINE.read_bytes()).hexdigest()).encode()).hexdigest()[:20]
    cache = Path(os.environ.get("ATLAS_CACHE", Path.home() / ".cache" / "atlas")) / "taxonomy" / f"lcc-{key}.npy"
    if cache.exists():
        e = np.load(cache)
        if e.shape[0] == len(nodes):
            return e
    e = encode([n["text"] for n in nodes], model, batch_size=512)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, e)
    os.replace(tmp, cache)
    return e


def candidates(concept_emb: np.ndarray, model: str, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k outline nodes per concept by cosine -> (scores, node indices), best first."""
    import faiss

    nodes_e = node_embeddings(model)
    index = faiss.IndexFlatIP(nodes_e.shape[1])
    index.add(np.ascontiguousarray(nodes_e, np.float32))
    return index.search(np.ascontiguousarray(concept_emb, np.float32), min(top_k, len(nodes_e)))


def map_concepts(concepts: pa.Table, model: str, top_k: int = 5, picker=None) -> tuple[pa.Table, dict]:
    """Fill the ``taxonomy_*`` columns of ``concepts``.

    ``picker(concepts, candidate_paths) -> list[int | None]``: optional chooser (the LLM) of an
    index into each concept's candidates; None (or an unusable answer) keeps the top one.
    """
    nodes = load_outline()
    if concepts.num_rows == 0:
        return concepts, {"mapped": 0}
    emb = to_matrix(concepts.column("embedding"))
    scores, idx = candidates(emb, model, top_k)
    picks = [0] * concepts.num_rows
    n_llm = 0
    if picker is not None:
        cand_paths = [[" > ".join(nodes[j]["path"][1:]) for j in row] for row in idx]
        for i, p in enumerate(picker(concepts, cand_paths)):
            if p is not None and 0 <= p < idx.shape[1]:
                picks[i] = p
                n_llm += 1
    chosen = [nodes[idx[i, p]] for i, p in enumerate(picks)]
    score = [float(scores[i, p]) for i, p in enumerate(picks)]
    cols = {
        "taxonomy_node": pa.array([n["id"] for n in chosen], pa.string()),
        "taxonomy_path": pa.array([n["path"] for n in chosen], pa.list_(pa.string())),
        "taxonomy_class": pa.array([n["class"] for n in chosen], pa.string()),
        "taxonomy_score": pa.array(score, pa.float32()),
    }
    out = concepts
    for name, arr in cols.items():
        out = out.set_column(out.schema.get_field_index(name), out.schema.field(name), arr)
    return out, {"mapped": concepts.num_rows, "llm_picks": n_llm, "classes": len(set(n["class"] for n in chosen)), "nodes": len(set(n["id"] for n in chosen))}


def class_distribution(concepts: pa.Table) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in concepts.column("taxonomy_class").to_pylist():
        if c is not None:
            counts[c] = counts.get(c, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def plot_distribution(concepts: pa.Table, title: str = "Concepts by LCC top class") -> bytes:
    """Bar chart of concept counts per LCC top-level class (paper Fig. 12) -> PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dist = class_distribution(concepts)
    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    keys = list(dist)
    ax.bar(range(len(keys)), [dist[k] for k in keys], color="#4C72B0")
    ax.set_xticks(range(len(keys)), [f"{k}\n{LCC_CLASSES.get(k, '')[:14]}" for k in keys], fontsize=7)
    ax.set_ylabel("concepts")
    ax.set_title(f"{title} (n={sum(dist.values())})")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def accuracy(gold: list[dict], model: str, top_k: int = 5) -> dict:
    """Mapping accuracy on hand-labelled concepts ({name, description, class, subclass})."""
    nodes = load_outline()
    e = encode([f"{g['name']}: {g['description']}" for g in gold], model)
    _, idx = candidates(e, model, top_k)
    top = [nodes[row[0]] for row in idx]
    cls = sum(n["class"] in g["class"].split("|") for n, g in zip(top, gold))
    sub = sum(n["prefix"] in g["subclass"].split("|") for n, g in zip(top, gold))
    in_k = sum(any(nodes[j]["prefix"] in g["subclass"].split("|") for j in row) for row, g in zip(idx, gold))
    return {
        "n": len(gold),
        "class_accuracy": cls / len(gold),
        "subclass_accuracy": sub / len(gold),
        f"subclass_in_top{top_k}": in_k / len(gold),
        "predicted": [f"{n['prefix']} {n['path'][-1]}" for n in top],
    }


def llm_picker(engine, cache_root=None, use_cache: bool = True, seed: int = 0):
    """A ``map_concepts`` picker asking the engine to choose among the candidate nodes
    (choice-constrained: the answer can only be one of the candidate numbers)."""
    from atlas.engine import Sampling
    from atlas.stage2 import prompts

    def pick(concepts: pa.Table, cand_paths: list[list[str]]) -> list[int | None]:
        template = engine.chat_template
        names = concepts.column("name").to_pylist()
        descs = concepts.column("description").to_pylist()
        keys, texts, samplings = [], [], []
        for i, (n, d, cands) in enumerate(zip(names, descs, cand_paths)):
            choices = prompts.taxonomy_choices(len(cands), template)
            keys.append(str(i))
            texts.append(prompts.taxonomy_prompt(n, d, cands, template))
            samplings.append(Sampling(max_tokens=4, temperature=0.0, seed=seed, choice=tuple(choices)).key())
        reqs = pa.table({"key": keys, "prompt": texts, "sampling": samplings})
        out, _ = engine.generate(reqs, cache_root=cache_root, use_cache=use_cache)
        picks: list[int | None] = []
        for raw, err in zip(out.column("text").to_pylist(), out.column("error").to_pylist()):
            s = (raw or "").strip()
            picks.append(int(s) - 1 if err is None and s.isdigit() else None)
        return picks

    return pick

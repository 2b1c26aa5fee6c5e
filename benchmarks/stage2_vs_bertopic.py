"""Stage 2 concepts side by side with BERTopic on the same tagged chunks (issue #9 item 10).

Input: an Atlas run's output root (``file://`` or ``s3://``) with ``chunks``, ``chunk_tags`` and
``chunk_concepts`` published (Stage 1 + Stage 2); without one, the script first runs Stage 1
and 2 itself (``atlas run``, the demo's engine settings, judge and Stage 3 off) on WikiText-2
from ../shared (the demo corpus when absent), tagging ``--tag-chunks`` chunks: about 25 min on
2 cores, reused from the generation cache when rerun. The document set is every chunk Stage 1
tagged without error. Topics:

  atlas      Stage 2 concepts: a concept's members are the chunks ``chunk_concepts`` assigns
             to it (multi-label: a chunk may be in several).
  atlas partition  the same concepts as a hard partition, as BERTopic's topics are: each chunk
             only in its strongest concept (most of its tags map there). Overlapping topics
             share top words, which the diversity score counts against them.
  bertopic   BERTopic on the same chunk texts, with the same embedding model (the run's
             ``stage2.embedding_model``, embeddings computed once and passed in), its
             defaults otherwise (UMAP + HDBSCAN, min_topic_size 10; outlier topic -1 left out).
  random     control: the same chunks shuffled into topics of exactly atlas's sizes (and of
             bertopic's), so each figure has its chance level beside it.

Each topic is represented the same way for every method: its top words by class-based
TF-IDF (BERTopic's own ``ClassTfidfTransformer``) over one ``CountVectorizer`` (English stop
words and WikiText's "unk", words seen in >= 2 chunks) fitted on all the chunks. Metrics:

  NPMI       gensim ``CoherenceModel(coherence="c_npmi")`` of each topic's top 10 words with
             the chunk texts as reference corpus; mean over topics, bootstrap 95% CI over topics.
  diversity  unique words among all topics' top 25 / (25 x topics) (Dieng et al. 2020), and
             per-topic uniqueness TU (Nan et al. 2019: mean over a topic's top 25 words of
             1 / the number of topics listing the word), mean with a bootstrap CI over topics.

Methods with different topic counts are not directly comparable on diversity (more topics
share more words), so atlas is also scored on its N largest concepts at BERTopic's N.

    python benchmarks/stage2_vs_bertopic.py [RUN_ROOT] [--min-chunks 2000]

Needs the ``bench`` extra (``pip install -e ".[bench]"``; ``make bench`` installs it): BERTopic and
gensim are benchmark-only peers, not dependencies of Atlas.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WIKITEXT2 = ROOT.parent / "shared" / "data" / "corpus" / "wikitext2"
DEMO = ROOT / "atlas" / "demo" / "corpus"
DEMO_CONFIG = ROOT / "atlas" / "demo" / "demo.yaml"  # the demo's engine and Stage 2 settings

from atlas import storage  # noqa: E402
from atlas.config import Stage2Config  # noqa: E402


def log(msg: str) -> None:
    print(f"[bertopic-vs-atlas {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", flush=True)


def run_stages_1_2(out: Path, corpus: Path, tag_chunks: int) -> str:
    """Stage 1 + 2 of ``atlas run`` on ``corpus`` into ``out`` (up-to-date stages are skipped)."""
    cmd = [sys.executable, "-m", "atlas.cli", "run", "--input", str(corpus), "--output", out.resolve().as_uri(),
           "--config", str(DEMO_CONFIG)]
    for override in (f"stage1.max_chunks={tag_chunks}", "judge.enabled=false", "stage3.enabled=false"):
        cmd += ["--set", override]
    log(f"running Stage 1 + 2: {' '.join(cmd)}")
    subprocess.run(cmd, check=True)
    return out.resolve().as_uri()


def tagged_chunks(root: storage.Location) -> tuple[list[str], list[str]]:
    tags = storage.read_table(root, "chunk_tags", ["chunk_id", "error"])
    ok = tags.filter(pc.is_null(tags.column("error"))).column("chunk_id")
    chunks = storage.read_table(root, "chunks", ["chunk_id", "text"])
    chunks = chunks.filter(pc.is_in(chunks.column("chunk_id"), value_set=ok)).sort_by("chunk_id")
    return chunks.column("chunk_id").to_pylist(), chunks.column("text").to_pylist()


def atlas_topics(chunk_concepts: pl.DataFrame, chunk_ids: list[str], partition: bool = False) -> list[np.ndarray]:
    """Member chunk indices per concept, largest first. ``partition``: each chunk only in its
    strongest concept (most of its tags map there; ties to the larger concept, then the id), a
    hard partition like BERTopic's."""
    row = pl.DataFrame({"chunk_id": chunk_ids, "i": np.arange(len(chunk_ids))})
    df = chunk_concepts.join(row, on="chunk_id").unique(["i", "concept_id"])
    if partition:
        df = (df.with_columns(support=pl.len().over("concept_id"))
              .sort(["n_tags", "support", "concept_id"], descending=True).unique("i", keep="first"))
    groups = df.group_by("concept_id").agg(pl.col("i").sort(), n=pl.len()).sort(["n", "concept_id"], descending=[True, False])
    return [np.array(g) for g in groups["i"].to_list()]


def bertopic_topics(texts: list[str], embeddings: np.ndarray, nr_topics: int | str | None, seed: int) -> list[np.ndarray]:
    from bertopic import BERTopic
    from umap import UMAP

    umap = UMAP(n_neighbors=15, n_components=5, min_dist=0.0, metric="cosine", random_state=seed)
    model = BERTopic(umap_model=umap, nr_topics=nr_topics, calculate_probabilities=False, verbose=False)
    labels = np.asarray(model.fit_transform(texts, embeddings)[0])
    topics = [np.flatnonzero(labels == t) for t in sorted(set(labels.tolist())) if t != -1]
    return sorted(topics, key=len, reverse=True)


def random_topics(sizes: list[int], n_docs: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.choice(n_docs, size=min(s, n_docs), replace=False) for s in sizes]


class Scorer:
    """One vocabulary, one c-TF-IDF and one NPMI reference corpus for every method."""

    def __init__(self, texts: list[str]):
        from gensim.corpora import Dictionary
        from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, CountVectorizer

        # "unk": WikiText's <unk> placeholder for rare words, in every chunk and in no topic's meaning
        stop = sorted(ENGLISH_STOP_WORDS | {"unk"})
        self.vectorizer = CountVectorizer(stop_words=stop, min_df=2, token_pattern=r"(?u)\b[a-zA-Z][a-zA-Z]+\b")
        self.counts = self.vectorizer.fit_transform(texts)
        self.vocab = np.array(self.vectorizer.get_feature_names_out())
        analyse = self.vectorizer.build_analyzer()
        known = set(self.vocab.tolist())
        self.tokens = [[w for w in analyse(t) if w in known] for t in texts]
        self.dictionary = Dictionary(self.tokens)

    def top_words(self, topics: list[np.ndarray], n: int) -> list[list[str]]:
        import scipy.sparse as sp
        from bertopic.vectorizers import ClassTfidfTransformer

        per_class = sp.vstack([sp.csr_matrix(self.counts[idx].sum(axis=0)) for idx in topics])
        weights = ClassTfidfTransformer().fit_transform(per_class).toarray()
        return [self.vocab[np.argsort(-w, kind="stable")[:n]].tolist() for w in weights]

    def npmi(self, top10: list[list[str]]) -> np.ndarray:
        from gensim.models.coherencemodel import CoherenceModel

        cm = CoherenceModel(topics=top10, texts=self.tokens, dictionary=self.dictionary, coherence="c_npmi", topn=10, processes=1)
        return np.array(cm.get_coherence_per_topic(), float)


def diversity(top25: list[list[str]]) -> tuple[float, np.ndarray]:
    """(Dieng's unique-word share, per-topic TU)."""
    from collections import Counter

    count = Counter(w for words in top25 for w in set(words))
    unique = len(count) / max(1, sum(len(w) for w in top25))
    tu = np.array([np.mean([1.0 / count[w] for w in words]) for words in top25])
    return unique, tu


def boot_ci(values: np.ndarray, seed: int, n_boot: int = 2000) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    v = values[np.isfinite(values)]
    if len(v) < 2:
        return float("nan"), float("nan")
    means = v[rng.integers(0, len(v), (n_boot, len(v)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", help="Atlas run output root with Stage 1 and Stage 2 tables (default: run them here)")
    ap.add_argument("--corpus", default=str(WIKITEXT2 if WIKITEXT2.exists() else DEMO), help="corpus when no root is given")
    ap.add_argument("--out", default="benchmark-bertopic", help="where the run goes when no root is given")
    ap.add_argument("--tag-chunks", type=int, default=2200, help="chunks Stage 1 tags when no root is given")
    ap.add_argument("--min-chunks", type=int, default=2000)
    ap.add_argument("--min-topic-chunks", type=int, default=2, help="atlas concepts with fewer member chunks are left out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    log(f"start; os.getloadavg() = {os.getloadavg()}")
    root = storage.resolve(args.root or run_stages_1_2(Path(args.out) / "run", Path(args.corpus), args.tag_chunks))
    chunk_ids, texts = tagged_chunks(root)
    short = len(texts) < args.min_chunks
    if short:  # the demo corpus alone has ~1,200 chunks: still run, but say the figure is below the bar
        log(f"WARNING: only {len(texts)} tagged chunks, fewer than --min-chunks {args.min_chunks}")
    chunk_concepts = pl.from_arrow(storage.read_table(root, "chunk_concepts", ["chunk_id", "concept_id", "n_tags"]))
    ours = [t for t in atlas_topics(chunk_concepts, chunk_ids) if len(t) >= args.min_topic_chunks]
    ours_hard = [t for t in atlas_topics(chunk_concepts, chunk_ids, partition=True) if len(t) >= args.min_topic_chunks]
    covered = len(set(np.concatenate(ours).tolist())) if ours else 0
    log(f"{len(texts)} tagged chunks; atlas: {len(ours)} concepts with >= {args.min_topic_chunks} chunks, covering {covered}")

    from atlas.stage2.embed import encode

    model = Stage2Config().embedding_model
    emb = np.asarray(encode(texts, model), np.float32)
    log(f"embedded {len(texts)} chunks with {model}")
    theirs = bertopic_topics(texts, emb, None, args.seed)
    log(f"bertopic (defaults): {len(theirs)} topics covering {sum(len(t) for t in theirs)} chunks (rest: outliers)")

    scorer = Scorer(texts)
    methods: dict[str, list[np.ndarray]] = {
        "atlas (all concepts)": ours,
        f"atlas ({len(theirs)} largest)": ours[:len(theirs)],
        "atlas partition (all)": ours_hard,
        f"atlas partition ({len(theirs)} largest)": ours_hard[:len(theirs)],
        "bertopic (defaults)": theirs,
    }
    if len(theirs) > len(ours) >= 2:
        methods[f"bertopic (reduced to {len(ours)})"] = bertopic_topics(texts, emb, len(ours) + 1, args.seed)  # +1: outliers
    methods["random, atlas sizes"] = random_topics([len(t) for t in ours], len(texts), args.seed)
    methods["random, atlas partition sizes"] = random_topics([len(t) for t in ours_hard], len(texts), args.seed + 2)
    methods["random, bertopic sizes"] = random_topics([len(t) for t in theirs], len(texts), args.seed + 1)

    rows = []
    for name, topics in methods.items():
        top = scorer.top_words(topics, 25)
        npmi = scorer.npmi([w[:10] for w in top])
        unique, tu = diversity(top)
        rows.append((name, len(topics), int(np.median([len(t) for t in topics])), npmi, unique, tu))
        log(f"{name}: {len(topics)} topics; e.g. {top[0][:6]}")

    print()
    print(f"Stage 2 vs BERTopic on {len(texts)} tagged chunks (same chunks, same embeddings {model}; "
          f"topics as top c-TF-IDF words; 95% bootstrap CI over topics)"
          + (f" -- BELOW the {args.min_chunks}-chunk bar" if short else ""))
    print("| method | topics | median chunks/topic | NPMI (top 10) | diversity (top 25) | TU (top 25) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, n, med, npmi, unique, tu in rows:
        lo, hi = boot_ci(npmi, args.seed)
        tlo, thi = boot_ci(tu, args.seed)
        print(f"| {name} | {n} | {med} | {np.nanmean(npmi):.3f} [{lo:.3f}, {hi:.3f}] | {unique:.3f} | "
              f"{tu.mean():.3f} [{tlo:.3f}, {thi:.3f}] |")
    print(f"\nwall {time.perf_counter() - t0:.0f} s; os.getloadavg() = {os.getloadavg()}")


if __name__ == "__main__":
    main()

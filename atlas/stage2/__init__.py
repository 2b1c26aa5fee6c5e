"""Stage 2: raw tags -> a canonical, versioned concept library.

Steps (each a pure function over Arrow tables / numpy, testable alone; the Stage classes in
:mod:`atlas.stage2.stages` wire them onto the runner's stage interface):

* :mod:`~atlas.stage2.embed`    unique normalised tags with counts, embedded with
  sentence-transformers in Ray Data actors -> ``tag_embeddings``
* :mod:`~atlas.stage2.cluster`  FAISS spherical k-means (fit on a sample, assign all) or
  HDBSCAN, then coherence filtering -> ``tag_clusters``, ``clusters``
* :mod:`~atlas.stage2.label`    LLM name + one-sentence description per kept cluster through
  the engine layer -> ``cluster_labels``
* :mod:`~atlas.stage2.merge`    cosine merging (FAISS range search + connected components) and
  stable concept ids -> ``concepts``, ``tag_concepts``, ``chunk_concepts``
* :mod:`~atlas.stage2.taxonomy` mapping onto the shipped LCC outline, Fig. 12 plot
* :mod:`~atlas.stage2.quality`  Fig. 6 quality sweep (silhouette, Davies-Bouldin, coherence)
* :mod:`~atlas.stage2.pipeline` all steps in order on in-memory tables (tests, benchmarks)

Concept id rule: ``"c-" + sha256(anchor_tag)[:16]`` where the anchor tag is the concept's most
frequent member tag (ties: lexicographically smallest); see docs/stage2.md.
"""

"""Stage 3: distil a concept annotator from Stage 2 labels, evaluate it, annotate a corpus.

- ``annotators``: the fast (hashed n-grams) and encoder (MiniLM) annotators, one interface.
- ``labels``: Stage 2 tables -> (texts, multi-hot labels, concept index, library version).
- ``train``: head training under Ray Train + per-concept threshold calibration.
- ``evaluate``: held-out F1 / kappa / per-concept P/R with a random-label control, PNG.
- ``annotate``: resumable Ray Data annotation job writing Parquet partitioned by source.
- ``stages``: thin Stage classes for the runner (atlas.stage).
"""

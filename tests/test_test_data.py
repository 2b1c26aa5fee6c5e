"""The data shipped under tests/data/ is exactly what tests/data/README.md documents."""

import hashlib
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def test_shipped_test_data_matches_documented_hashes():
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    listed = dict((p, h) for h, p in re.findall(r"^\s+([0-9a-f]{64})  (\S+)$", readme, flags=re.M))
    assert {"corpus/wikitext2_excerpt/valid.txt", "scaling/chinchilla_figure4_extracted.csv", "stage2_taxonomy_gold.json"} <= set(listed)
    for rel, digest in listed.items():
        assert hashlib.sha256((DATA / rel).read_bytes()).hexdigest() == digest, rel
    shipped = {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file() and p.name != "README.md"}
    assert shipped == set(listed), "every shipped data file needs a README entry (source, licence, hash)"

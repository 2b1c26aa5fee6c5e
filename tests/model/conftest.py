import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Shipped with the project (first 20 WikiText-2 validation articles; see tests/data/README.md),
# so a fresh clone runs these tests without ../shared.
CORPUS = ROOT / "tests" / "data" / "corpus" / "wikitext2_excerpt"


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def corpus_path():
    assert CORPUS.is_dir(), f"shipped test corpus missing: {CORPUS}"
    return CORPUS


@pytest.fixture(scope="session")
def small_docs(corpus_path):
    from model.corpus import read_documents

    return read_documents(corpus_path)[:12]


@pytest.fixture(scope="session")
def tokenizer(small_docs):
    from model.tokenizer import train_tokenizer

    return train_tokenizer(small_docs, 512)

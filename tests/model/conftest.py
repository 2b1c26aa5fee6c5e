import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# STEERLING_TEST_CORPUS overrides (e.g. a git worktree whose parent has no shared/)
CORPUS = Path(os.environ.get("STEERLING_TEST_CORPUS", ROOT.parent / "shared" / "data" / "corpus" / "wikitext2"))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def corpus_path():
    if not CORPUS.exists():
        pytest.skip(f"corpus not found at {CORPUS}")
    return CORPUS


@pytest.fixture(scope="session")
def small_docs(corpus_path):
    from model.corpus import read_documents

    return read_documents(corpus_path)[:12]


@pytest.fixture(scope="session")
def tokenizer(small_docs):
    from model.tokenizer import train_tokenizer

    return train_tokenizer(small_docs, 512)

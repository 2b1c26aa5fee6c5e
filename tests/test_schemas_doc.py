from pathlib import Path

import pyarrow as pa
import pytest

from atlas import schemas


def test_tables_doc_is_generated_from_schemas():
    doc = Path(__file__).resolve().parents[1] / "docs" / "tables.md"
    assert doc.read_text() == schemas.describe() + "\n", "docs/tables.md is stale: run `atlas schemas > docs/tables.md`"


def test_conform_names_missing_columns():
    t = pa.table({"chunk_id": ["a"], "doc_id": ["d"]})
    with pytest.raises(ValueError, match=r"\['chunk_index', 'text'"):
        schemas.conform(t, schemas.CHUNKS)

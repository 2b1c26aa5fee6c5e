"""`atlas train --demo` trains on the `atlas demo` run in the working directory when it has
published annotations, and says it falls back to STAND-IN labels when not (no Ray here)."""

from __future__ import annotations

import pyarrow as pa

from atlas import cli_train, storage


def test_demo_data_is_the_atlas_demo_run_when_it_has_annotations(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_train._atlas_demo_run() is None
    assert "STAND-IN" in capsys.readouterr().out
    root = storage.resolve(str(tmp_path / "atlas-demo-output"))
    storage.write_table(root, "chunks", pa.table({"chunk_id": ["a"]}))  # a run without annotations yet
    assert cli_train._atlas_demo_run() is None
    storage.write_table(root, "annotations", pa.table({"chunk_id": ["a"]}))
    assert cli_train._atlas_demo_run() == str(tmp_path / "atlas-demo-output")
    assert "Atlas demo run" in capsys.readouterr().out

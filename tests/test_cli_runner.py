"""`atlas run` end to end through the CLI (its own local Ray), the manifest, status and query."""

import json
import os
import subprocess
import sys

import pytest

from atlas import query
from atlas.cli import main

from tests.conftest import DEMO_CORPUS, REPO


def _atlas(*args, check=True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "atlas.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"atlas {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.slow
def test_run_ingest_and_chunk_records_manifest(tmp_path, minilm_tokenizer_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:2]:
        (corpus / p.name).write_text(p.read_text())
    (corpus / "empty.txt").write_text("")
    out = tmp_path / "out"
    log = tmp_path / "log.jsonl"
    _atlas(
        "run", "--input", str(corpus), "--output", f"file://{out}", "--stages", "ingest", "chunk",
        "--set", f"chunking.tokenizer={minilm_tokenizer_path}", "--set", "ray.num_cpus=2",
        "--set", "ray.object_store_memory_mb=300", "--run-id", "cli-test", "--log-file", str(log),
    )
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["run_id"] == "cli-test" and manifest["status"] == "done"
    assert set(manifest["stages"]) == {"ingest", "chunk"}
    ing, ch = manifest["stages"]["ingest"], manifest["stages"]["chunk"]
    assert ing["status"] == ch["status"] == "done"
    assert ing["stats"]["documents"] == 2 and ing["stats"]["quarantined"] == 1
    assert ing["tables"]["documents"]["rows"] == 2
    assert ch["tables"]["chunks"]["rows"] == ch["stats"]["chunks"] > 10
    assert manifest["config"]["chunking"]["tokenizer"] == minilm_tokenizer_path
    assert "ray" in manifest["packages"] and "pyarrow" in manifest["packages"]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["stage"] for e in events if e["event"] == "stage done"] == ["ingest", "chunk"]

    status = _atlas("status", str(out), "--json")
    assert json.loads(status.stdout)["stages"]["chunk"]["status"] == "done"
    df = query.sql(str(out), "SELECT doc_id, count(*) AS n, sum(n_tokens) AS tokens FROM chunks GROUP BY doc_id ORDER BY doc_id")
    assert df.height == 2 and int(df["n"].sum()) == ch["stats"]["chunks"]
    assert query.scan(str(out), "quarantine").collect()["reason"].to_list() == ["empty"]


def test_cli_errors_name_the_problem(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("stage1:\n  max_tagz: 3\n")
    assert main(["run", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--config", str(cfg)]) == 2
    assert "stage1.max_tagz: unknown key" in capsys.readouterr().err
    assert main(["run", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--stages", "tagging"]) == 2
    assert "unknown stage(s) ['tagging']" in capsys.readouterr().err

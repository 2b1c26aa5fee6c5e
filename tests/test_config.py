import pytest

from atlas.config import ConfigError, load_config


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("input: /data\noutput: s3://b/out\nchunking:\n  target_tokens: 100\nstage1:\n  max_tags: 4\n")
    cfg = load_config(f, overrides=["stage1.max_tags=8", "engine.device=gpu", "engine.tensor_parallel_size=2"], output="file:///x")
    assert cfg.chunking.target_tokens == 100
    assert cfg.stage1.max_tags == 8  # override beats file
    assert cfg.engine.device == "gpu" and cfg.engine.tensor_parallel_size == 2
    assert cfg.output == "file:///x"  # a keyword field beats both
    assert cfg.input == "/data"


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("chunking:\n  target_tokns: 100\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "chunking.target_tokns: unknown key" in str(e.value)
    with pytest.raises(ConfigError, match="engine.bogus: unknown key"):
        load_config(overrides=["engine.bogus=1"])


def test_invalid_values_are_named():
    with pytest.raises(ConfigError, match="chunking"):
        load_config(overrides=["chunking.min_tokens=500"])  # min > target
    with pytest.raises(ConfigError, match="engine.backend"):
        load_config(overrides=["engine.backend=llamacpp"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(overrides=["stage1.max_tags"])


def test_run_id_generated_and_validated():
    cfg = load_config().with_run_id()
    assert cfg.run_id and cfg.with_run_id().run_id == cfg.run_id
    with pytest.raises(ConfigError, match="run_id"):
        load_config(run_id="a/b")

import json

import jax
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.cli import main
from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint


def test_convert_command_writes_a_loadable_checkpoint(tmp_path, capsys):
    config = tiny_llada_config()
    hf = write_hf_checkpoint(tmp_path / "hf", config, shards=2)
    assert main(["convert", str(hf), str(tmp_path / "out"), "--dtype", "float32", "--quiet"]) == 0
    assert "converted" in capsys.readouterr().out
    ids = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(np.asarray(load_model(tmp_path / "out", dtype="float32")(ids)),
                                  np.asarray(load_model(hf, dtype="float32")(ids)))


def test_convert_command_reports_bad_checkpoints_without_a_traceback(tmp_path, capsys):
    config = tiny_llada_config()
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    (hf / "model.safetensors").write_bytes(b"\x00" * 4)
    assert main(["convert", str(hf), str(tmp_path / "out")]) == 2
    assert "corrupt or truncated" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_demo_runs_and_prints_timing(capsys):
    assert main(["demo", "--hidden", "64", "--layers", "2", "--seq-len", "32", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "logits (2, 32, 1024) float32" in out and "median of 2" in out
    assert "after commit the cache holds 36 positions" in out


@pytest.mark.parametrize("command", ["convert", "generate", "analyze", "bench", "demo", "eval"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: dllm-jax {command}" in text and "--dtype" in text
    if command in ("generate", "analyze"):
        assert "--method {dense,sparsed,pulsecol,sparge,mage,flashblock,flashblock+mage}" in text
        assert "--mage-k N" in text and "--tau N|none" in text


def test_analyze_writes_the_plots_and_a_summary(checkpoints, tmp_path, capsys):
    llada, sdar = checkpoints
    assert main(["analyze", "--model", str(llada), "--prompt", "w1 w2 w3", "--gen-length", "32", "--steps", "8",
                 "--block-length", "16", "--method", "sparsed", "--sparse-block", "16", "--dtype", "float32",
                 "--out", str(tmp_path / "llada")]) == 0
    summary = json.loads((tmp_path / "llada" / "summary.json").read_text())
    assert summary["sparse_steps"] == 5 and 0 < summary["recall"] < 1 and summary["l1"] > 0
    for name in ("recall", "jaccard", "error", "head_patterns"):
        assert (tmp_path / "llada" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["analyze", "--model", str(sdar), "--prompt", "w1 w2 w3", "--gen-length", "8", "--method", "mage",
                 "--mage-k", "2", "--exact-layers", "1", "--out", str(tmp_path / "sdar")]) == 0
    summary = json.loads((tmp_path / "sdar" / "summary.json").read_text())
    assert 0 <= summary["recall"] <= 1 and summary["later_steps"] > 0
    assert sorted(p.name for p in (tmp_path / "sdar").iterdir()) == ["error.png", "recall.png", "summary.json"]
    capsys.readouterr()
    assert main(["analyze", "--model", str(llada), "--prompt", "w1", "--out", str(tmp_path / "x")]) == 2
    assert "analyze compares a sparse --method with dense attention" in capsys.readouterr().err


def test_bench_writes_json_and_markdown(tmp_path, capsys):
    assert main(["bench", "--lengths", "128", "--densities", "0.5", "--context", "64", "--new-tokens", "16",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("bench_*.json")
    data = json.loads(result.read_text())
    assert data["backend"] == "cpu" and data["jax"] == jax.__version__
    attention = [r for r in data["rows"] if r["section"] == "attention"]
    assert [r["n"] for r in attention] == [128] and attention[0]["block_sparse_ms"]["0.5"] > 0
    generated = {(r["model"], r["config"].split("(")[0]) for r in data["rows"] if r["section"] == "generate"}
    assert generated == {("tiny-llada", m) for m in ("dense", "sparsed", "pulsecol", "sparge")} | \
        {("tiny-sdar", m) for m in ("dense", "mage", "flashblock", "flashblock+mage")}
    assert all(r["per_forward_ms"] > 0 for r in data["rows"] if r["section"] == "generate")
    table = result.with_suffix(".md").read_text()
    assert "| 128 |" in table and "tiny-sdar" in table and "cpu, jax " + jax.__version__ in table

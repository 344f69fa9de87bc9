import numpy as np

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

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.bench import family_methods
from dllm_jax.cli import main
from dllm_jax.eval import load_tokenizer, make_samples
from dllm_jax.families import FAMILIES
from dllm_jax.testing import tiny_llada_config, write_hf_checkpoint

TRAINED = Path(__file__).parent.parent / "checkpoints"


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


def test_demo_answers_a_fresh_passkey_question_with_the_trained_sdar_model(tmp_path, capsys):
    # only the SDAR checkpoint in --checkpoints: the LLaDA one gets the one-line note, whether or not it is shipped
    (tmp_path / "tiny-sdar-tasks").symlink_to(TRAINED / "tiny-sdar-tasks")
    assert main(["demo", "--checkpoints", str(tmp_path), "--seed", "1", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    # the expected key comes from the task generator, not from the demo
    key = make_samples("passkey", 1024, 1, 1, load_tokenizer(TRAINED / "tiny-sdar-tasks"))[0].answer
    sdar, llada = out.split("\n== ")[1:]
    assert sdar.startswith("tiny-sdar-tasks\nSDAR: ") and "HF -> Orbax in" in sdar
    assert f"the key {key!r} hides at token" in sdar and "what is the pass key ? answer :" in sdar
    assert f"answer: {key!r}: correct (" in sdar and "s compiled)" in sdar
    assert "passkey at 1024 tokens, 2 fresh samples (seed 1; the first is the question above): " in sdar
    assert llada.startswith("tiny-llada-tasks: not in ") and llada.count("\n") == 1


def test_demo_refuses_a_directory_without_trained_checkpoints_and_a_short_context_in_one_line(tmp_path, capsys):
    assert main(["demo", "--checkpoints", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dllm-jax demo: error: --checkpoints {tmp_path} holds none of the trained checkpoints")
    assert err.count("\n") == 1
    assert main(["demo", "--checkpoints", str(TRAINED), "--context", "10"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("dllm-jax demo: error: --context 10 is too short") and not captured.out


def test_train_command_writes_a_loadable_hf_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--family", "llada", "--config", "tiny", "--task", "passkey", "--context", "64",
                 "--steps", "3", "--warmup", "1", "--batch", "2", "--out", str(out), "--no-progress"]) == 0
    assert "step 3/3; loss " in capsys.readouterr().out
    model = load_model(out / "hf", dtype="float32", progress=False)
    assert type(model).__name__ == "LLaDA" and model.config.num_layers == 2
    assert np.isfinite(np.asarray(model(np.arange(3, 19).reshape(1, 16)))).all()
    assert load_tokenizer(out / "hf").get_vocab_size() == model.config.vocab_size


def test_train_command_refuses_bad_flags_and_inputs_with_exit_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse: its usage lines, then one error line
        main(["train", "--family", "gpt", "--steps", "3", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dllm-jax train ")
    assert err.strip().splitlines()[-1].startswith("dllm-jax train: error: argument --family: invalid choice: 'gpt'")
    # a refused value: one line, no usage, no traceback, nothing written
    assert main(["train", "--family", "sdar", "--task", "nope", "--steps", "3", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm-jax train: error: --task") and "nope" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", ["convert", "generate", "analyze", "bench", "demo", "eval", "train"])
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
    # one method per family beside dense (each method's generate loop is tested in its own file; the default list
    # is tested below)
    assert main(["bench", "--lengths", "128", "--densities", "0.5", "--context", "64", "--new-tokens", "16",
                 "--repeats", "1", "--methods", "dense", "sparsed", "flashblock+mage", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("bench_*.json")
    data = json.loads(result.read_text())
    assert data["backend"] == "cpu" and data["jax"] == jax.__version__
    attention = [r for r in data["rows"] if r["section"] == "attention"]
    assert [r["n"] for r in attention] == [128] and attention[0]["block_sparse_ms"]["0.5"] > 0
    generated = {(r["model"], r["config"].split("(")[0]) for r in data["rows"] if r["section"] == "generate"}
    assert generated == {("tiny-llada", "dense"), ("tiny-llada", "sparsed"), ("tiny-sdar", "dense"),
                         ("tiny-sdar", "flashblock+mage")}
    assert data["methods"] == ["dense", "sparsed", "flashblock+mage"]
    assert all(r["per_forward_ms"] > 0 for r in data["rows"] if r["section"] == "generate")
    table = result.with_suffix(".md").read_text()
    assert "| 128 |" in table and "tiny-sdar" in table and "cpu, jax " + jax.__version__ in table


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bench_times_dense_and_every_method_of_the_family_by_default(family):
    assert list(family_methods(FAMILIES[family].label, small=True)) == ["dense", *FAMILIES[family].methods]


@pytest.mark.parametrize("methods, message", [(["dense", "magic"], "unknown method(s) ['magic']"),
                                              (["mage"], "method(s) ['mage'] apply to none of the models' families")])
def test_bench_refuses_a_method_it_cannot_time(tmp_path, capsys, methods, message):
    assert main(["bench", "--sections", "generate", "--models", "tiny-llada", "--methods", *methods,
                 "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written

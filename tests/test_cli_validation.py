"""`dllm-jax` refuses bad flags and inputs by name, exit status 2, before anything slow (issue 16).

Flag values are refused by argparse (its usage lines, then one `error: argument --flag: ...` line);
everything else is one line on stderr. Most refusals need no weights: the checks read config.json only,
so these tests write nothing else and would fail with a different message if the CLI went further.
"""

import json
import os
import re

import numpy as np
import pytest

from dllm_jax import generate, load_model
from dllm_jax.cli import main
from dllm_jax.testing import (random_hf_tensors, tiny_llada_config, tiny_sdar_config, write_hf_checkpoint,
                              write_tiny_tokenizer)
from dllm_jax.tokenizer import ChatTokenizer


def exit_status(argv) -> int:
    """main's exit status, returned or raised by argparse as SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def flag_refusal(capsys, argv) -> str:
    """The `error:` line of an argparse refusal (after its usage lines)."""
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "Traceback" not in err
    return err.strip().splitlines()[-1]


def refusal(capsys, argv) -> str:
    """The single stderr line of a refused input (besides the progress bars of a loader that ran)."""
    assert exit_status(argv) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not re.search(r"\d+%\|", line)]
    assert len(lines) == 1, lines
    return lines[0]


def config_only(directory, config):
    """A checkpoint directory with config.json and nothing else: the CLI must refuse before it needs more."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_config()))
    return str(directory)


GEN = ["generate", "--model", "unused", "--prompt", "w1"]


@pytest.mark.parametrize("argv,expected", [
    (GEN + ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (GEN + ["--gen-length", "-8"], "argument --gen-length: must be a positive integer, got -8"),
    (GEN + ["--block-length", "0"], "argument --block-length: must be a positive integer, got 0"),
    (GEN + ["--top-k", "-1"], "argument --top-k: must be a non-negative integer, got -1"),
    (GEN + ["--seed", str(2**40)], f"argument --seed: must be a 32-bit integer, got {2**40}"),
    (GEN + ["--method", "mage", "--mage-k", "0"], "argument --mage-k: must be a positive integer, got 0"),
    (GEN + ["--method", "flashblock", "--tau", "-1"], "argument --tau: must be a non-negative integer, got -1"),
    (["analyze", "--model", "m", "--prompt", "p", "--layer", "-1"], "argument --layer: must be a non-negative"),
    (["demo", "--context", "0"], "argument --context: must be a positive integer, got 0"),
    (["bench", "--repeats", "0"], "argument --repeats: must be a positive integer, got 0"),
    (["bench", "--lengths", "128", "0"], "argument --lengths: must be a positive integer, got 0"),
    (GEN + ["--factor", "0"], "argument --factor: must be a positive number, got 0"),
    (GEN + ["--mesh", "tp=2,pp=2"], "argument --mesh: mesh axis 'pp' in 'tp=2,pp=2' is not one of ('dp', 'sp', 'tp')"),
    (["eval", "--model", "m", "--task", "passkey", "--mesh", "tp=0"], "argument --mesh: mesh axis tp=0 in 'tp=0' must"),
])
def test_non_positive_counts_are_refused_by_argparse(capsys, argv, expected):
    line = flag_refusal(capsys, argv)
    assert line.startswith(f"dllm-jax {argv[0]}: error: ") and expected in line


@pytest.mark.parametrize("argv,flag,value", [
    (GEN + ["--temperature", "-1"], "--temperature", "-1"),
    (GEN + ["--temperature", "nan"], "--temperature", "nan"),
    (GEN + ["--temperature", "inf"], "--temperature", "inf"),
    (GEN + ["--cfg-scale", "inf"], "--cfg-scale", "inf"),
    (GEN + ["--cfg-scale", "-0.5"], "--cfg-scale", "-0.5"),
    (GEN + ["--top-p", "nan"], "--top-p", "nan"),
    (GEN + ["--top-p", "0"], "--top-p", "0"),
    (GEN + ["--confidence-threshold", "nan"], "--confidence-threshold", "nan"),
    (GEN + ["--method", "sparsed", "--skip", "nan"], "--skip", "nan"),
    (GEN + ["--method", "sparsed", "--select", "inf"], "--select", "inf"),
    (GEN + ["--method", "sparge", "--pvthreshd", "inf"], "--pvthreshd", "inf"),
    (GEN + ["--method", "pulsecol", "--eta", "inf"], "--eta", "inf"),
    (["bench", "--densities", "0.5", "nan"], "--densities", "nan"),
])
def test_non_finite_and_negative_numbers_are_refused_by_argparse(capsys, argv, flag, value):
    line = flag_refusal(capsys, argv)
    assert f"error: argument {flag}: must be " in line and line.endswith(f"got {value}")


def test_a_word_for_a_number_still_names_the_kind(capsys):
    assert "argument --steps: invalid int value: 'many'" in flag_refusal(capsys, GEN + ["--steps", "many"])
    assert "argument --pvthreshd: expected float or 'none', got 'x'" in \
        flag_refusal(capsys, GEN + ["--method", "sparge", "--pvthreshd", "x"])


@pytest.mark.parametrize("family,flags,expected", [
    # given explicitly, even at the other family's default value, a flag is refused rather than ignored
    ("llada", ["--top-k", "0"], "--top-k applies to SDAR models; this checkpoint is LLaDA"),
    ("llada", ["--top-p", "1", "--confidence-threshold", "0.85"],
     "--top-p, --confidence-threshold apply to SDAR models; this checkpoint is LLaDA"),
    ("llada", ["--remasking", "sequential"], "--remasking sequential applies to SDAR models; this checkpoint is LLaDA"),
    ("sdar", ["--cfg-scale", "0"], "--cfg-scale applies to LLaDA models; this checkpoint is SDAR"),
    ("sdar", ["--block-length", "4"], "--block-length applies to LLaDA models; this checkpoint is SDAR"),
    ("sdar", ["--cache", "dual"], "--cache applies to LLaDA models; this checkpoint is SDAR"),
    ("sdar", ["--threshold", "0.9"], "--threshold applies to LLaDA models; this checkpoint is SDAR"),
    ("llada", ["--cache-refresh", "2"], "--cache-refresh 2 needs --cache 'prefix' or 'dual'"),  # named by flag
    ("sdar", ["--remasking", "random"], "--remasking random applies to LLaDA models; this checkpoint is SDAR"),
    ("llada", ["--kv-cache-dtype", "fp8"], "--kv-cache-dtype applies to SDAR models; this checkpoint is LLaDA"),
    ("sdar", ["--temperature", "0"], "--temperature 0: SDAR's sampler divides the logits by the temperature"),
    ("sdar", ["--remasking", "sequential", "--confidence-threshold", "0.5"],
     "--confidence-threshold applies to --remasking low_confidence_dynamic only, not sequential"),
    # generate's own option checks also run before any weights are needed
    ("llada", ["--gen-length", "10", "--block-length", "4"], "--gen-length 10 must be a multiple of --block-length 4"),
])
def test_flags_of_the_other_family_are_refused_by_name(tmp_path, capsys, family, flags, expected):
    config = tiny_llada_config() if family == "llada" else tiny_sdar_config()
    model = config_only(tmp_path / family, config)
    line = refusal(capsys, ["generate", "--model", model, "--prompt", "w1", *flags])
    assert line.startswith("dllm-jax generate: error: ") and expected in line


def test_analyze_checks_out_and_layer_before_the_run(tmp_path, capsys):
    llada = config_only(tmp_path / "llada", tiny_llada_config(num_layers=2))
    sdar = config_only(tmp_path / "sdar", tiny_sdar_config())
    run = ["analyze", "--prompt", "w1", "--method", "sparsed"]
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    assert f"--out {existing} is an existing file" in refusal(capsys, [*run, "--model", llada, "--out", str(existing)])
    assert existing.read_text() == "keep me"
    below_file = existing / "plots"
    assert f"--out {below_file} cannot be created: {existing} is a file" in \
        refusal(capsys, [*run, "--model", llada, "--out", str(below_file)])
    # the old CLI wrote recall/jaccard/error.png, then failed on the layer: now nothing is created
    out = tmp_path / "plots"
    assert "--layer 2 is not a layer of this model: it has 2" in \
        refusal(capsys, [*run, "--model", llada, "--layer", "2", "--out", str(out)])
    assert "--layer applies to LLaDA models" in \
        refusal(capsys, ["analyze", "--model", sdar, "--prompt", "w1", "--method", "mage", "--layer", "0",
                         "--out", str(out)])
    assert not out.exists()


def test_convert_to_an_unusable_place_is_one_line(tmp_path, capsys):
    hf = write_hf_checkpoint(tmp_path / "hf", tiny_llada_config())
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = refusal(capsys, ["convert", str(hf), str(blocker / "out"), "--quiet"])
    assert line.startswith("dllm-jax convert: error: ") and str(blocker) in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_convert_into_a_read_only_directory_is_one_line(tmp_path, capsys):
    hf = write_hf_checkpoint(tmp_path / "hf", tiny_llada_config())
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    line = refusal(capsys, ["convert", str(hf), str(locked / "out"), "--quiet"])
    assert line.startswith("dllm-jax convert: error: ") and str(locked) in line


def test_a_multi_line_checkpoint_report_is_one_line(tmp_path, capsys):
    config = tiny_llada_config()
    tensors = random_hf_tensors(config)
    for name in sorted(tensors)[:2]:
        del tensors[name]
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    line = refusal(capsys, ["convert", str(hf), str(tmp_path / "out"), "--quiet"])
    assert all(name in line for name in sorted(random_hf_tensors(config))[:2])
    assert not (tmp_path / "out").exists()


def test_convert_keeps_the_source_dtype_by_default(tmp_path, capsys):
    """An fp32 source converted without --dtype loads in fp32 exactly as the source (was: stored as bf16).
    Needs convert_hf_checkpoint(dtype=None) = the source's dtype."""
    hf = write_hf_checkpoint(tmp_path / "hf", tiny_llada_config(), dtype="float32")
    assert main(["convert", str(hf), str(tmp_path / "out"), "--quiet"]) == 0
    assert "(the source's dtype)" in capsys.readouterr().out
    ids = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(np.asarray(load_model(tmp_path / "out", dtype="float32", progress=False)(ids)),
                                  np.asarray(load_model(hf, dtype="float32", progress=False)(ids)))


def test_a_checkpoint_with_nan_weights_is_refused(tmp_path, capsys):
    """Was: converted, and generated "[UNK]" with exit status 0. Needs the converter's and the loader's
    non-finite checks."""
    config = tiny_llada_config(mask_token_id=150, eos_token_id=141, pad_token_id=141)
    tensors = random_hf_tensors(config)
    name = sorted(tensors)[-1]
    tensors[name][0, ...] = np.nan
    hf = write_hf_checkpoint(tmp_path / "hf", config, tensors=tensors)
    write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
    line = refusal(capsys, ["convert", str(hf), str(tmp_path / "out"), "--quiet"])
    assert line.startswith("dllm-jax convert: error: ") and ("nan" in line.lower() or "finite" in line)
    assert not (tmp_path / "out").exists()
    line = refusal(capsys, ["generate", "--model", str(hf), "--prompt", "w1", "--gen-length", "4"])
    assert line.startswith("dllm-jax generate: error: ") and ("nan" in line.lower() or "finite" in line)


def test_sdar_prints_at_most_gen_length_tokens(tmp_path, capsys):
    """SDAR decodes whole blocks (block 4 here): 6 asked after a 7-token prompt decodes 9; 6 are printed."""
    config = tiny_sdar_config(vocab_size=160, mask_token_id=150, eos_token_ids=(141,), pad_token_id=141)
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    write_tiny_tokenizer(hf, 160, mask_token_id=150, eos_token_id=141)
    assert main(["generate", "--model", str(hf), "--prompt", "w1 w2", "--dtype", "float32", "--gen-length", "6",
                 "--steps", "2", "--top-k", "1"]) == 0
    out, err = capsys.readouterr()
    tok = ChatTokenizer(hf)
    ids = tok.encode("w1 w2")
    full = np.asarray(generate(load_model(hf, dtype="float32", progress=False), ids, max_new_tokens=6,
                               denoising_steps=2, top_k=1))[0, ids.shape[1]:]
    assert ids.shape[1] == 7 and len(full) == 9  # no stop token: the whole last block is decoded
    assert out.strip() == tok.decode(full[:6], skip=(150,)).strip()
    assert "7 prompt tokens, 6 generated of 9 decoded in whole blocks of 4" in err


def test_prompt_sources_are_one_of_two(capsys):
    both = flag_refusal(capsys, ["generate", "--model", "m", "--prompt", "w1", "--prompts-file", "p.txt"])
    assert "argument --prompts-file: not allowed with argument --prompt" in both
    neither = flag_refusal(capsys, ["generate", "--model", "m"])
    assert "one of the arguments --prompt --prompts-file is required" in neither


@pytest.mark.parametrize("content,expected", [
    (b"", "holds no prompt (it is empty): write one prompt per line"),
    (b"\n  \n\t\r\n", "holds no prompt (only blank lines): write one prompt per line"),
    # on line 1: the file is streamed, so a later line is read after the tokenizer (this directory has none)
    (b"w1 \xff\xfe\nw2\n", "is not UTF-8 text (invalid start byte at byte 3)"),
])
def test_a_prompts_file_without_prompts_is_refused_by_name(tmp_path, capsys, content, expected):
    model = config_only(tmp_path / "llada", tiny_llada_config())  # refused before the tokenizer is needed
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    line = refusal(capsys, ["generate", "--model", model, "--prompts-file", str(path)])
    assert line == f"dllm-jax generate: error: --prompts-file {path} {expected}"
    missing = tmp_path / "missing.txt"
    line = refusal(capsys, ["generate", "--model", model, "--prompts-file", str(missing)])
    assert line == f"dllm-jax generate: error: --prompts-file {missing} cannot be opened: No such file or directory"


def test_analyze_takes_one_prompt(tmp_path, capsys):
    model = config_only(tmp_path / "llada", tiny_llada_config())
    run = ["analyze", "--model", model, "--method", "sparsed", "--out", str(tmp_path / "plots")]
    assert refusal(capsys, [*run, "--prompt", "w1", "--prompt", "w2"]) == \
        "dllm-jax analyze: error: analyze takes one prompt, but --prompt given 2: run it once per prompt"
    path = tmp_path / "prompts.txt"
    path.write_text("w1\nw2\nw3\n")
    assert refusal(capsys, [*run, "--prompts-file", str(path)]) == \
        f"dllm-jax analyze: error: analyze takes one prompt, but --prompts-file {path} holds 3: run it once per prompt"
    assert not (tmp_path / "plots").exists()


def test_bad_prompts_of_a_batch_are_refused_before_loading(tmp_path, capsys):
    """Needs the tokenizer (prompt lengths) but no weights: the directory has none."""
    model = config_only(tmp_path / "llada", tiny_llada_config(mask_token_id=150, eos_token_id=141, pad_token_id=141))
    write_tiny_tokenizer(model, 160, mask_token_id=150, eos_token_id=141)
    # the LLaDA sparse kernels take no padding mask: left-padded rows would attend to the pads
    line = refusal(capsys, ["generate", "--model", model, "--prompt", "w1 w2", "--prompt", "w3", "--method", "sparsed"])
    assert line.startswith("dllm-jax generate: error: --method sparsed runs on unpadded prompts only") and \
        "(7, 6) tokens" in line
    line = refusal(capsys, ["generate", "--model", model, "--raw", "--prompt", "w1", "--prompt", ""])
    assert line == "dllm-jax generate: error: prompt 2 of 2 (''): the prompt encodes to no tokens"

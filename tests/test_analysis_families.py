"""Pattern diagnostics on the two newer families: Dream through `analyze` (bidirectional, as LLaDA) and
LLaDA2 through `analyze_blocks` (block diffusion over a prefix cache, as SDAR), from Python and from
`dllm-jax analyze`, on tiny random checkpoints with a word-level tokenizer ("w<i>" is id i).

References: a method keeping every key has recall 1 and no error by definition; the tokens are generate's
(tested against ports of the official samplers in tests/test_dream.py and tests/test_llada2.py)."""

import dataclasses
import json

import numpy as np
import pytest

from dllm_jax import MAGE, SparseD, generate, load_model
from dllm_jax.analysis import analyze, analyze_blocks
from dllm_jax.attention.policy import Mode
from dllm_jax.cli import main
from dllm_jax.generate.llada2 import LLaDA2Options, answers
from dllm_jax.testing import tiny_dream_config, write_hf_checkpoint, write_tiny_tokenizer
from test_llada2 import EOS, MASK, TINY, write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# The CLI tests pass the same options, method and prompt (--raw "w1 .. wN"), so their runs reuse the
# loops the Python tests compiled.
DREAM_OPTIONS = dict(max_new_tokens=16, steps=8, alg="entropy", temperature=0.5)
DREAM_FLAGS = ["--gen-length", "16", "--steps", "8", "--remasking", "entropy", "--temperature", "0.5"]
LLADA2_OPTIONS = dict(gen_length=16, block_length=4, steps=4, threshold=0.9)
LLADA2_FLAGS = ["--gen-length", "16", "--block-length", "4", "--steps", "4", "--threshold", "0.9"]
SEED = 3


def words(n: int) -> tuple[np.ndarray, str]:
    return np.arange(1, n + 1, dtype=np.int32)[None], " ".join(f"w{i}" for i in range(1, n + 1))


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory):
    config = tiny_dream_config()
    directory = write_hf_checkpoint(tmp_path_factory.mktemp("dream_analysis"), config)
    return write_tiny_tokenizer(directory, config.vocab_size, mask_token_id=config.mask_token_id,
                                eos_token_id=config.eos_token_id)


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory):
    cfg = dataclasses.replace(TINY, num_hidden_layers=1, first_k_dense_replace=0)  # one MoE layer: compiles faster
    directory = tmp_path_factory.mktemp("llada2_analysis")
    write_checkpoint(directory, cfg, seed=4)
    return write_tiny_tokenizer(directory, cfg.vocab_size, mask_token_id=MASK, eos_token_id=EOS)


def test_dream_analysis_measures_the_method_and_keeps_generates_tokens(dream_checkpoint):
    model = load_model(dream_checkpoint, dtype="float32", progress=False)
    prompt, _ = words(16)
    full = analyze(model, prompt, SparseD(select=1.0, block_size=16), seed=SEED, **DREAM_OPTIONS)
    np.testing.assert_array_equal(full.recall, 1.0)  # every key kept: the oracle is inside the pattern
    np.testing.assert_allclose(full.l1, 0.0, atol=1e-5)

    method = SparseD(block_size=16)
    report = analyze(model, prompt, method, seed=SEED, **DREAM_OPTIONS)
    layers, heads, steps = model.config.num_layers, model.config.num_heads, DREAM_OPTIONS["steps"]
    assert report.recall.shape == report.jaccard.shape == report.l1.shape == (layers, steps, 1, heads)
    sparse = report.modes == Mode.SPARSE
    assert sparse.sum() == steps - (int(steps * 0.2) + 2)  # SparseD: skip 20% dense, one estimate step
    np.testing.assert_array_equal(report.recall[:, ~sparse], 1.0)
    assert (report.recall[:, sparse] < 1).any() and (report.l1[:, sparse] > 0).all()
    assert np.isnan(report.jaccard[:, 0]).all() and ((report.jaccard[:, 1:] >= 0) & (report.jaccard[:, 1:] <= 1)).all()
    n = prompt.shape[1] + DREAM_OPTIONS["max_new_tokens"]
    assert report.attention.shape == (layers, 1, heads, n, n)
    # the probe observes without changing anything: generate's tokens, same method, options and seed
    np.testing.assert_array_equal(report.tokens, generate(model, prompt, method=method, seed=SEED, **DREAM_OPTIONS))


def test_llada2_analysis_measures_the_method_on_the_dense_trajectory(llada2_checkpoint):
    model = load_model(llada2_checkpoint, dtype="float32", progress=False)
    prompt, _ = words(12)
    full = analyze_blocks(model, prompt, MAGE(k=64, exact_layers=0), seed=SEED, **LLADA2_OPTIONS)
    later = full.later()
    assert later.any() and np.isfinite(full.recall[:, later]).all()  # the prompt blocks make a prefix
    np.testing.assert_array_equal(full.recall[np.isfinite(full.recall)], 1.0)  # k >= the prefix: all kept
    np.testing.assert_allclose(full.l1, 0.0, atol=1e-5)

    report = analyze_blocks(model, prompt, MAGE(k=2, exact_layers=0), seed=SEED, **LLADA2_OPTIONS)
    calls, c = len(report.modes), model.config
    assert report.recall.shape == (c.num_layers, calls, 1, c.num_kv_heads)
    assert report.l1.shape == (c.num_layers, calls, 1, c.num_heads)
    later = report.later()
    np.testing.assert_allclose(report.recall[:, report.step == 0], 1.0)  # a block's first step is its oracle
    assert (report.recall[:, later] < 1).any() and (report.l1[:, later] > 0).all()
    # the blocks decoded: 12 prompt tokens are 3 complete blocks of 4, then 16 tokens = 4 blocks
    assert sorted(set(report.prefix.tolist())) == [12, 16, 20, 24]
    # the dense trajectory: the tokens of dense generation (same options and seed)
    tokens = answers(report.tokens, prompt.shape[1], LLaDA2Options(**LLADA2_OPTIONS), model.config.eos_token_id)
    np.testing.assert_array_equal(np.stack(tokens), generate(model, prompt, seed=SEED, **LLADA2_OPTIONS))


def test_analysis_refuses_a_model_of_the_other_kind(dream_checkpoint, llada2_checkpoint):
    dream = load_model(dream_checkpoint, dtype="float32", progress=False)
    with pytest.raises(ValueError, match=r"analyze_blocks takes SDAR and LLaDA2 models, got Dream \(LLaDA and "
                                         r"Dream models: analyze\)"):
        analyze_blocks(dream, words(4)[0], MAGE(k=2), **LLADA2_OPTIONS)
    with pytest.raises(ValueError, match="analyze takes LLaDA and Dream models, got str"):
        analyze("not a model", words(4)[0], SparseD())


def test_cli_analyze_writes_the_plots_of_dream_and_llada2(dream_checkpoint, llada2_checkpoint, tmp_path, capsys):
    _, text = words(16)
    assert main(["analyze", "--model", str(dream_checkpoint), "--raw", "--prompt", text, *DREAM_FLAGS, "--seed",
                 str(SEED), "--method", "sparsed", "--sparse-block", "16", "--dtype", "float32",
                 "--out", str(tmp_path / "dream")]) == 0
    summary = json.loads((tmp_path / "dream" / "summary.json").read_text())
    assert summary["sparse_steps"] == 5 and 0 < summary["recall"] < 1 and summary["l1"] > 0
    for name in ("recall", "jaccard", "error", "head_patterns"):
        assert (tmp_path / "dream" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

    _, text = words(12)
    assert main(["analyze", "--model", str(llada2_checkpoint), "--raw", "--prompt", text, *LLADA2_FLAGS,
                 "--method", "mage", "--mage-k", "2", "--exact-layers", "0", "--dtype", "float32",
                 "--out", str(tmp_path / "llada2")]) == 0
    summary = json.loads((tmp_path / "llada2" / "summary.json").read_text())
    assert 0 < summary["recall"] < 1 and summary["l1"] > 0 and summary["later_steps"] > 0
    assert sorted(p.name for p in (tmp_path / "llada2").iterdir()) == ["error.png", "recall.png", "summary.json"]
    capsys.readouterr()
    assert main(["analyze", "--model", str(llada2_checkpoint), "--prompt", "w1", "--method", "mage", "--layer", "0",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--layer applies to LLaDA models and Dream ones" in capsys.readouterr().err

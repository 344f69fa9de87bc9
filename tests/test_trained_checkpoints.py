"""The trained checkpoints shipped in checkpoints/ (see checkpoints/README.md): they load through the HF
path and through conversion to Orbax, and answer fresh samples (evaluation seeds lie below the
training seeds, which start at 2**31)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dllm_jax
from dllm_jax import eval as dev
from dllm_jax.checkpoint.api import convert_hf_checkpoint
from dllm_jax.testing import user_environment
from dllm_jax.train.data import TRAIN_SEED_FLOOR

CHECKPOINTS = Path(__file__).parent.parent / "checkpoints"
TRAINED = {"tiny-sdar-tasks": "SDAR", "tiny-llada-tasks": "LLaDA"}
LONG = {"tiny-sdar-long": "SDAR"}  # trained to 16k tokens (issue 39's bar: >= 95% at 1k-16k on fresh seeds)
SHIPPED = TRAINED | LONG
# what both models reach >= 95% on with fresh seeds (checkpoints/README.md), checked here on small samples
LEARNED = [("passkey", 1024), ("niah_multikey", 1024), ("variable_tracking", 1024), ("sanity", 64)]


@pytest.fixture(scope="module")
def models():
    """{name: model in float32} of every shipped checkpoint, loaded once for the module."""
    return {name: dllm_jax.load_model(CHECKPOINTS / name, dtype="float32", progress=False) for name in SHIPPED}


@pytest.fixture(params=sorted(SHIPPED))
def trained(request, models):
    """(directory, model in float32) of one shipped checkpoint."""
    return CHECKPOINTS / request.param, models[request.param]


@pytest.fixture(scope="module")
def tokenizer():
    return dev.load_tokenizer(CHECKPOINTS / "tiny-sdar-tasks")


def test_shipped_checkpoint_is_small_and_uses_the_task_tokenizer(trained):
    directory, model = trained
    assert type(model).__name__ == SHIPPED[directory.name]
    assert (directory / "model.safetensors").stat().st_size <= 25 * 2**20
    assert dev.load_tokenizer(directory).get_vocab() == dev.build_tokenizer().get_vocab()
    config, ids = model.config, dev.SPECIAL_IDS
    eos = config.eos_token_ids if SHIPPED[directory.name] == "SDAR" else (config.eos_token_id,)
    assert (config.mask_token_id, config.pad_token_id, eos) == (ids.mask, ids.pad, (ids.eos,))
    assert config.vocab_size >= dev.VOCAB_SIZE


def test_shipped_checkpoint_converts_to_the_same_model(trained, tmp_path, rng):
    directory, model = trained
    out = tmp_path / "orbax"
    convert_hf_checkpoint(directory, out, progress=False)
    converted = dllm_jax.load_model(out, dtype="float32", progress=False)
    ids = rng.integers(3, dev.VOCAB_SIZE, (1, 48))
    np.testing.assert_allclose(np.asarray(converted(ids)), np.asarray(model(ids)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, task, context", [(n, t, c) for n in TRAINED for t, c in LEARNED])
def test_shipped_checkpoint_answers_fresh_samples(tmp_path, rng, name, task, context):
    """Through `dllm-jax eval` in a process of its own that compiles as a user's does: the 1k-token LLaDA
    passes are execution-bound, ~2.4x slower under `make test`'s LLVM -O0 (TEST_XLA_FLAGS). In bfloat16,
    the dtype the weights are stored in (10 LLaDA passkey samples at 1k on 2 cores: 12.7 s of generation,
    27.5 s before the CPU attention ran head-major)."""
    assert_answers(tmp_path, rng, name, task, context, dtype="bfloat16")


@pytest.mark.parametrize("name", sorted(LONG))
def test_long_context_checkpoint_answers_fresh_samples_at_4k(tmp_path, rng, name):
    """Variable tracking (the task the long runs found hardest) at 4k tokens, in bfloat16 (~30 s for the
    10 samples on 2 cores, most of it the 4k prefill; float32 is slower there)."""
    assert_answers(tmp_path, rng, name, "variable_tracking", 4096, dtype="bfloat16")


def assert_answers(tmp_path, rng, name: str, task: str, context: int, dtype: str) -> None:
    """>= 9 of 10 samples of a fresh evaluation seed (never a training one) right, through `dllm-jax eval`."""
    seed = int(rng.integers(0, TRAIN_SEED_FLOOR))
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "dllm_jax.cli", "eval", "--model", str(CHECKPOINTS / name),
                          "--task", task, "--context", str(context), "--samples", "10", "--seed", str(seed),
                          "--batch-size", "10", "--dtype", dtype, "--json", str(out), "--quiet"],
                         env=user_environment(os.environ), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["num_samples"] == 10 and result["tasks"] == [task] and result["context_lengths"] == [context]
    assert result["accuracy"] >= 0.9, (seed, [(r["answer"], r["predicted"]) for r in result["records"]])


def test_evaluation_is_deterministic_for_a_seed(trained, tokenizer):
    _, model = trained

    def predictions():
        samples = dev.make_samples("passkey", context_length=256, num_samples=3, seed=7, tokenizer=tokenizer)
        return [r.predicted_ids for r in dev.evaluate(model, samples, tokenizer=tokenizer, progress=False).records]

    assert predictions() == predictions()

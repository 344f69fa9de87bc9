"""The trained checkpoints shipped in checkpoints/ (see checkpoints/README.md): they load through the HF
path and through conversion to Orbax, and answer fresh samples (evaluation seeds lie below the
training seeds, which start at 2**31)."""

from pathlib import Path

import numpy as np
import pytest

import dllm_jax
from dllm_jax import eval as dev
from dllm_jax.checkpoint.api import convert_hf_checkpoint
from dllm_jax.train.data import TRAIN_SEED_FLOOR

SDAR_TASKS = Path(__file__).parent.parent / "checkpoints" / "tiny-sdar-tasks"


@pytest.fixture(scope="module")
def sdar():
    return dllm_jax.load_model(SDAR_TASKS, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    return dev.load_tokenizer(SDAR_TASKS)


def test_shipped_sdar_checkpoint_is_small_and_uses_the_task_tokenizer(sdar):
    assert (SDAR_TASKS / "model.safetensors").stat().st_size <= 25 * 2**20
    ids = dev.SPECIAL_IDS
    assert (sdar.config.mask_token_id, sdar.config.pad_token_id, sdar.config.eos_token_ids) == (ids.mask, ids.pad,
                                                                                                 (ids.eos,))
    assert sdar.config.vocab_size >= dev.VOCAB_SIZE


def test_shipped_sdar_checkpoint_converts_to_the_same_model(sdar, tmp_path, rng):
    out = tmp_path / "orbax"
    convert_hf_checkpoint(SDAR_TASKS, out, progress=False)
    converted = dllm_jax.load_model(out, dtype="float32", progress=False)
    ids = rng.integers(3, dev.VOCAB_SIZE, (1, 48))
    np.testing.assert_allclose(np.asarray(converted(ids)), np.asarray(sdar(ids)), rtol=1e-6, atol=1e-6)


def test_shipped_sdar_checkpoint_retrieves_the_passkey_at_1k(sdar, tokenizer, rng):
    seed = int(rng.integers(0, TRAIN_SEED_FLOOR))  # a fresh evaluation seed, never a training one
    samples = dev.make_samples("passkey", context_length=1024, num_samples=8, seed=seed, tokenizer=tokenizer)
    result = dev.evaluate(sdar, samples, tokenizer=tokenizer, progress=False)
    assert result.accuracy >= 0.9, [(r.answer, r.predicted) for r in result.records]


def test_evaluation_is_deterministic_for_a_seed(sdar, tokenizer):
    samples = dev.make_samples("passkey", context_length=256, num_samples=3, seed=7, tokenizer=tokenizer)
    first = dev.evaluate(sdar, samples, tokenizer=tokenizer, progress=False)
    again = dev.evaluate(sdar, dev.make_samples("passkey", context_length=256, num_samples=3, seed=7,
                                                tokenizer=tokenizer), tokenizer=tokenizer, progress=False)
    assert [r.predicted_ids for r in first.records] == [r.predicted_ids for r in again.records]

"""Batched SDAR generation: each left-padded row equals generating its prompt alone."""

import numpy as np
import pytest

import dllm_jax
from dllm_jax.generate import generate
from dllm_jax.generate import sdar as gen_sdar
from dllm_jax.testing import tiny_sdar_config


@pytest.fixture(scope="module")
def model(tiny_model):
    # a small vocabulary makes stop tokens (41, 42) likely on random weights
    config = tiny_sdar_config(vocab_size=48, mask_token_id=40, eos_token_ids=(41, 42), pad_token_id=42)
    return tiny_model(config, seed=21)


def left_pad(prompts, pad_id):
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def assert_rows_match_single(model, prompts, **options) -> int:
    """Batched rows == one-prompt generation as far as both reach; pads after a row's end.
    Returns how many rows stopped before their last block."""
    pad = model.config.pad_token_id
    ids, mask = left_pad(prompts, pad)
    width = ids.shape[1]
    out = generate(model, ids, attention_mask=mask, **options)
    assert out.shape == (len(prompts), width + options["max_new_tokens"]) and out.dtype == np.int32
    stopped = 0
    for row, prompt in enumerate(prompts):
        single = generate(model, np.asarray(prompt)[None], **options)[0]
        start = width - len(prompt)
        np.testing.assert_array_equal(out[row, :start], ids[row, :start])  # the padding as given
        got = out[row, start:]
        n = min(len(got), len(single))
        np.testing.assert_array_equal(got[:n], single[:n], err_msg=f"row {row} (prompt length {len(prompt)})")
        if len(single) < len(got):  # stopped early: the rest of the row is padding
            stopped += 1
            assert np.isin(single[-1], model.config.eos_token_ids)
            assert (got[len(single):] == pad).all()
    return stopped


# prompts that end mid-block, on a block boundary, inside the first block, and one block long
PROMPT_LENGTHS = (7, 8, 2, 4, 5)


@pytest.mark.parametrize("options", [
    dict(remasking="sequential", top_k=1, denoising_steps=4),  # the acceptance check
    dict(remasking="low_confidence_dynamic", denoising_steps=4, temperature=0.8),  # sampled: per-row draws
    dict(remasking="low_confidence_static", denoising_steps=2),
], ids=["sequential_greedy", "dynamic_sampled", "static_2_steps"])
def test_batched_rows_equal_single_prompts(model, rng, options):
    stopped = 0
    for seed in range(2):
        prompts = [rng.integers(0, 40, n) for n in PROMPT_LENGTHS]
        stopped += assert_rows_match_single(model, prompts, max_new_tokens=13, seed=seed, **options)
    if options["remasking"] != "sequential":
        assert stopped, "no row stopped early: per-row stops were not exercised"


@pytest.mark.parametrize("method", ["mage", "flashblock", "flashblock_mage"])
def test_batched_methods_equal_single_prompts(model, rng, method):
    policy = {"mage": dllm_jax.MAGE(k=5, exact_layers=1),
              "flashblock": dllm_jax.FlashBlock(tau=2),
              "flashblock_mage": dllm_jax.FlashBlock(tau=2, inner=dllm_jax.MAGE(k=5, exact_layers=1))}[method]
    prompts = [rng.integers(0, 40, n) for n in (14, 6, 9)]
    assert_rows_match_single(model, prompts, max_new_tokens=10, seed=1, method=policy,
                             remasking="low_confidence_dynamic", denoising_steps=4, confidence_threshold=0.3)


def test_unpadded_batch_is_batched_output(model, rng):
    prompts = rng.integers(0, 40, (2, 6))
    out = generate(model, prompts, max_new_tokens=8, seed=0, remasking="sequential", top_k=1)
    assert out.shape == (2, 14)
    for row in range(2):
        single = generate(model, prompts[row:row + 1], max_new_tokens=8, seed=0, remasking="sequential", top_k=1)[0]
        n = min(len(single), 14)
        np.testing.assert_array_equal(out[row, :n], single[:n])


def test_bad_padding_raises_before_compiling(model):
    before = gen_sdar.generate_sdar_jit._cache_size()
    ids = np.ones((3, 6), np.int32)
    good = np.ones((3, 6), np.int32)
    all_pad = good.copy()
    all_pad[1] = 0
    with pytest.raises(ValueError, match="row 1 is all padding"):
        generate(model, ids, attention_mask=all_pad)
    right_pad = good.copy()
    right_pad[2, 4:] = 0
    with pytest.raises(ValueError, match="row 2 is not left padding"):
        generate(model, ids, attention_mask=right_pad)
    holes = good.copy()
    holes[0, 2] = 0
    with pytest.raises(ValueError, match="row 0 is not left padding"):
        generate(model, ids, attention_mask=holes)
    limit = model.config.max_position_embeddings
    long_ids = np.ones((2, limit - 4), np.int32)
    mask = np.ones_like(long_ids)
    mask[0, :10] = 0
    with pytest.raises(ValueError, match="prompt row 1"):
        generate(model, long_ids, attention_mask=mask, max_new_tokens=8)
    with pytest.raises(ValueError, match="attention_mask shape"):
        generate(model, ids, attention_mask=np.ones((3, 5), np.int32))
    assert gen_sdar.generate_sdar_jit._cache_size() == before

"""Inference layouts: unrolled (fused, per-layer weights) and scan compute the same model."""

import jax
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.attention.mage import MAGE
from dllm_jax.generate import generate
from dllm_jax.models import block_diffusion, llada
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params, tiny_llada_config, tiny_sdar_config


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_unrolled_and_scan_give_the_same_logits(tiny_checkpoint, rng, family):
    config = tiny_llada_config() if family == "llada" else tiny_sdar_config()
    directory = tiny_checkpoint(config)
    unrolled = load_model(directory, dtype="float32", progress=False)
    scanned = load_model(directory, dtype="float32", progress=False, execution="scan")
    layers = unrolled.params()["layers"]
    assert isinstance(layers, tuple) and len(layers) == config.num_layers
    h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    assert layers[0]["qkv_proj"].shape == (config.hidden_size, (h + 2 * kv) * d)
    assert layers[0]["gate_up_proj"].shape == (config.hidden_size, 2 * config.intermediate_size)
    assert scanned.params()["layers"]["qkv_proj"].shape[0] == config.num_layers
    ids = rng.integers(0, config.mask_token_id, (2, 11))
    assert relative_error(unrolled(ids), scanned(ids)) <= 1e-6


def test_pure_functions_take_the_checkpoint_layout(rng):
    """The stacked, unfused tree the converter writes is fused inside the traced function."""
    config = tiny_llada_config()
    params = random_params(config, jax.random.key(3), np.float32)
    ids = rng.integers(0, config.mask_token_id, (1, 9))
    direct, _ = llada.forward(params, ids, config=config)
    prepared, _ = llada.forward(prepare_params(dict(params), config), ids, config=config)
    assert relative_error(direct, prepared) <= 1e-6


@pytest.mark.parametrize("method", [None, MAGE(k=4, exact_layers=1)])
def test_sdar_generation_is_the_same_in_both_layouts(tiny_checkpoint, rng, method):
    """Dense and MAGE (whose policy state the unrolled layers carry one entry per layer through a block's forwards,
    the scanned ones stacked)."""
    config = tiny_sdar_config()
    directory = tiny_checkpoint(config)
    prompt = rng.integers(0, config.mask_token_id, (1, 6))
    options = dict(max_new_tokens=8, remasking="sequential", top_k=1, seed=0, method=method)
    unrolled = generate(load_model(directory, dtype="float32", progress=False), prompt, **options)
    scanned = generate(load_model(directory, dtype="float32", progress=False, execution="scan"), prompt, **options)
    np.testing.assert_array_equal(unrolled, scanned)


def test_unknown_execution_raises(tiny_checkpoint):
    with pytest.raises(ValueError, match="execution='loop'"):
        load_model(tiny_checkpoint(tiny_sdar_config()), execution="loop")


def test_cache_is_per_layer_with_per_row_lengths():
    config = tiny_sdar_config()
    cache = block_diffusion.init_cache(config, 3, 16)
    assert len(cache.k) == len(cache.v) == config.num_layers
    assert cache.k[0].shape == (3, 16, config.num_kv_heads, config.head_dim)
    assert cache.length.shape == (3,)

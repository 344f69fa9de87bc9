"""Checks that only mean something on an NVIDIA GPU (run on the device: pytest -m gpu)."""

import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import load_model
from dllm_jax.attention.dense import dense_attention
from dllm_jax.testing import tiny_llada_config, tiny_sdar_config
from test_llada_numerics import BF16_BOUND, FP32_BOUND, relative_error
from torch_reference import llama_reference, reference_logits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hq,hkv", [(32, 32), (32, 8)])
def test_cudnn_attention_matches_xla(rng, hq, hkv):
    b, n, d = 2, 1000, 128
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(b, n, hq, d), (b, n, hkv, d), (b, n, hkv, d)])
    key_mask = jnp.asarray(np.arange(n)[None, :] >= np.array([[0], [300]]))  # row 1 left-padded
    out = dense_attention(q, k, v, key_mask=key_mask, backend="cudnn")
    expected = dense_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                               key_mask=key_mask, backend="xla")
    err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(expected)) / np.linalg.norm(np.asarray(expected))
    assert err < 1e-2


def test_llada_fp32_on_gpu_matches_torch(tiny_checkpoint, rng):
    config = tiny_llada_config(num_heads=4, num_kv_heads=2)
    hf = tiny_checkpoint(config, seed=7)
    ids = rng.integers(0, config.tokenizer_vocab_size, (2, 40))
    mask = np.ones_like(ids)
    mask[1, :9] = 0
    logits = load_model(hf, dtype="float32")(ids, mask, padding="mask")
    assert relative_error(logits, reference_logits(llama_reference(hf), ids, mask)) <= FP32_BOUND


def test_llada_bf16_cudnn_close_to_fp32(tiny_checkpoint, rng):
    config = tiny_llada_config(hidden_size=256, num_heads=2, num_kv_heads=2, intermediate_size=512)  # head_dim 128
    hf = tiny_checkpoint(config, seed=8)
    ids = rng.integers(0, config.tokenizer_vocab_size, (2, 64))
    mask = np.ones_like(ids)
    mask[0, :20] = 0
    fp32 = load_model(hf, dtype="float32")(ids, mask, padding="mask")
    bf16 = load_model(hf, dtype="bfloat16")(ids, mask, padding="mask")
    assert relative_error(bf16, np.asarray(fp32, np.float64)) <= BF16_BOUND


def test_sdar_cached_bf16_cudnn_matches_full_fp32(tiny_checkpoint, rng):
    """cuDNN with a fill length (cached step) and with a block-causal bias (full forward) on the GPU."""
    config = tiny_sdar_config(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512)
    hf = tiny_checkpoint(config, seed=9)
    bf16 = load_model(hf, dtype="bfloat16", progress=False)
    fp32 = load_model(hf, dtype="float32", progress=False)
    ids = rng.integers(0, config.vocab_size, (1, 44))
    cache = bf16.prefill(ids[:, :40], bf16.init_cache(1, 64))
    logits, _ = bf16.block_step(ids[:, 40:], cache)
    full32 = np.asarray(fp32(ids), np.float64)
    assert relative_error(logits, full32[:, 40:]) <= BF16_BOUND
    assert relative_error(bf16(ids), full32) <= BF16_BOUND


@pytest.mark.parametrize("method", ["sparsed", "pulsecol"])
@pytest.mark.parametrize("start", [1024, 1031, 1240])
def test_fast_dllm_window_through_the_pallas_kernels_matches_the_reference(rng, method, start):
    """A Fast-dLLM window (32 queries, bf16, 8B head shapes) against its cached keys in SPARSE mode:
    the Pallas kernels (Mosaic / Triton) give the jnp references' result, aligned or not."""
    import dataclasses

    from dllm_jax import PulseCol, SparseD
    from dllm_jax.attention.policy import Mode
    from dllm_jax.attention.pulsecol import num_keep, select_columns
    from dllm_jax.attention.sparsed import select_blocks

    b, n, h, d, width = 2, 1280, 8, 128, 32
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16) for _ in range(3))
    if method == "sparsed":
        policy = SparseD(backend="reference").bind(total_steps=64, prompt_length=1024)
        state = select_blocks(q, k, prefill_len=1024, block_size=128, select=0.3, backend="reference")
    else:
        policy = PulseCol(backend="reference").bind(total_steps=64)
        state = select_columns(q, k, group_size=32, num_keep=num_keep(n, 0.8), backend="reference")
        state = (state[0].astype(jnp.uint16), state[1])
    window = q[:, start:start + width]
    outs = [p.attend_window(window, k, v, state, jnp.int32(Mode.SPARSE), start=jnp.int32(start))
            for p in (policy, dataclasses.replace(policy, backend="auto"))]
    expected, got = (np.asarray(o, np.float32) for o in outs)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 2e-2
